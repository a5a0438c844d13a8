"""The typed settings (pdserve.config): one derivation of flags and variables, flags over
environment over defaults, messages that name what was wrong, `--help` that lists everything,
rendering that parses back, and the CUDA check a worker makes before it loads anything."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pdserve import cli, config
from pdserve.config import COMMANDS, DecodeConfig, FrontConfig, OperatorSettings, PrefillConfig, load, options, to_args

# Every flag the workers, the front and the operator took before their settings were typed:
# scripts, tests, docs and running pods use them.
EXISTING_FLAGS = {
    "prefill": "--model --served-model-name --nats-url --worker-id --device --dtype --block-size --metrics-port "
               "--threads --log-level --offer-timeout --transfer-timeout --kv-transports --kv-compression "
               "--kv-capacity-bytes --chunk-size --max-batch-tokens --announce-blocks --preposition-budget-blocks "
               "--preposition-queue --kv-stream-layers --no-kv-stream-layers --prefix-offload --no-prefix-offload "
               "--prefix-offload-ttl --data-port",
    "decode": "--model --served-model-name --nats-url --worker-id --device --dtype --block-size --metrics-port "
              "--threads --log-level --data-host --data-port --advertise-host --transfer-timeout --max-running "
              "--max-batch --kv-capacity-bytes --engine --spec-method --spec-max-k --spec-k-policy --draft-model "
              "--kv-compression --cpu-weight-layouts --no-cpu-weight-layouts",
    "front": "--model --served-model-name --nats-url --host --port --dispatch-timeout --first-token-timeout "
             "--token-timeout --kv-failure-policy --preposition --no-preposition --log-level",
}


@pytest.mark.parametrize("command", sorted(EXISTING_FLAGS))
def test_every_existing_flag_still_parses(command):
    p = config.parser(COMMANDS[command])
    known = set(p._option_string_actions)
    assert not set(EXISTING_FLAGS[command].split()) - known


def test_flags_win_over_environment_over_defaults():
    env = {"PDSERVE_SPEC_MAX_K": "4", "PDSERVE_KV_COMPRESSION": "int8", "PDSERVE_CPU_WEIGHT_LAYOUTS": "false",
           "PDSERVE_DTYPE": "", "POD_IP": "10.0.0.7"}
    d = load(DecodeConfig, ["--spec-max-k", "6", "--dtype", "bfloat16"], env)
    assert d.spec.max_k == 6, "a flag wins over its variable"
    assert d.kv.compression == "int8" and d.cpu_weight_layouts is False, "a variable wins over the default"
    assert d.dtype == "bfloat16" and d.advertise_host == "10.0.0.7"
    assert d.spec.k_policy == "adaptive" and d.max_batch == 32, "defaults where neither is given"
    assert load(DecodeConfig, [], {"PDSERVE_DTYPE": ""}).dtype == "auto", "an empty variable counts as unset"
    assert load(DecodeConfig, ["--no-cpu-weight-layouts"], {}).cpu_weight_layouts is False


def test_names_are_derived_in_one_place():
    """--group-field and PDSERVE_GROUP_FIELD for every option, except the few that keep a name of
    their own (stated in their field) — secrets and the downward API are never flags."""
    own_names = {"kv.timeout", "kv.shm_pool_bytes", "kv.shm_sender_map_bytes", "spec.draft_model", "spec.draft_pool",
                 "spec.draft_pool_timeout", "namespace",
                 "pod_name", "advertise_host", "own_namespace"}
    for cls in (*COMMANDS.values(), OperatorSettings):
        for o in options(cls):
            if o.flag:
                assert o.env == (o.env if o.path in own_names else "PDSERVE_" + o.flag[2:].upper().replace("-", "_"))
            if o.path not in own_names and o.flag:
                prefix = "-".join(o.path.split(".")[:-1])
                assert o.flag.startswith(f"--{prefix.replace('_', '-')}" if prefix else "--"), o
    secrets = {o.env for cls in COMMANDS.values() for o in options(cls) if not o.flag}
    assert {"PDSERVE_NATS_USER", "PDSERVE_NATS_PASSWORD", "PDSERVE_API_KEY", "POD_NAME"} <= secrets


@pytest.mark.parametrize("argv,env,needles", [
    (["--spec-max-k", "0"], {}, ["--spec-max-k='0'", "$PDSERVE_SPEC_MAX_K", "greater than or equal to 1"]),
    ([], {"PDSERVE_KV_COMPRESSION": "zstd"}, ["$PDSERVE_KV_COMPRESSION='zstd'", "--kv-compression", "'int8'"]),
    (["--device", "gpu"], {}, ["--device='gpu'", "use cpu, cuda or cuda:N"]),
    ([], {"PDSERVE_NATS_URL": "localhost:4222"}, ["$PDSERVE_NATS_URL='localhost:4222'", "nats://HOST:PORT"]),
    (["--spec-method", "draft"], {}, ["--spec-method draft needs --draft-model"]),
    (["--threads", "two"], {}, ["--threads='two'", "valid integer"]),
])
def test_bad_values_exit_with_a_message_naming_them(argv, env, needles, capsys):
    with pytest.raises(SystemExit) as e:
        load(DecodeConfig, argv, env, prog="pdserve decode")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve decode: error: invalid settings")
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_option_with_its_variable_and_default(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for o in options(COMMANDS[command]):
        assert f"${o.env}" in out, o
        if o.flag:
            assert o.flag in out, o
    assert "default: 32" in out or command != "decode"
    assert "$PDSERVE_NATS_PASSWORD" in out and "Read from the environment only" in out


def test_cli_checks_settings_with_the_models_the_workers_parse():
    """`pdserve <command>` refuses bad settings before importing torch, with the same model the
    process then runs with."""
    from pdserve.decode.worker import DecodeWorker
    from pdserve.prefill.worker import PrefillWorker

    assert COMMANDS["prefill"] is PrefillWorker.settings is PrefillConfig
    assert COMMANDS["decode"] is DecodeWorker.settings is DecodeConfig
    assert COMMANDS["front"] is FrontConfig and set(COMMANDS) <= set(cli.SUBCOMMANDS)


def _random_value(o: config.Option, rng: random.Random):
    f = o.field
    ann = f.annotation
    lo = next((m.ge for m in f.metadata if getattr(m, "ge", None) is not None), None)
    lo = lo if lo is not None else next((m.gt + 1 for m in f.metadata if getattr(m, "gt", None) is not None), 0)
    hi = next((m.le for m in f.metadata if getattr(m, "le", None) is not None), lo + 100000)
    if ann is bool:
        return rng.random() < 0.5
    if ann is int:
        return rng.randint(lo, hi)
    if ann is float:
        return round(rng.uniform(lo + 0.001, lo + 1000), rng.choice((0, 3)))
    if getattr(ann, "__origin__", None) is config.Literal:
        return rng.choice(ann.__args__)
    return None


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, FrontConfig, OperatorSettings], ids=lambda c: c.__name__)
def test_rendered_args_parse_back_to_the_same_settings(cls):
    """to_args (what the operator renders) and load (what the process parses) are inverses, for
    random values of every option that has a flag."""
    rng = random.Random(7)
    for _ in range(40):
        values = {}
        for o in options(cls):
            v = _random_value(o, rng)
            if o.flag and v is not None and rng.random() < 0.7:
                values[o.path] = v
        if cls is DecodeConfig and values.get("spec.method") == "draft":
            values["spec.draft_model"] = "/models/draft"
        if cls is DecodeConfig and values.get("spec.draft_pool"):
            values["spec.method"] = "ngram"  # the pool drafts beside prompt lookup only
        cfg = cls.model_validate(config._nest(values))
        args = to_args(cfg)
        assert load(cls, args, {}) == cfg, args
        assert len(args) >= len(values), "every explicit setting is rendered"


def test_to_args_renders_only_what_was_set_and_never_a_secret():
    cfg = DecodeConfig.model_validate({"threads": 3, "nats": {"url": "nats://n:4222", "password": "hunter2"},
                                       "spec": {"method": "ngram"}, "cpu_weight_layouts": False})
    assert to_args(cfg) == ["--nats-url", "nats://n:4222", "--threads", "3", "--no-cpu-weight-layouts",
                            "--spec-method", "ngram"]


def test_deployment_scope():
    assert load(FrontConfig, [], {}).deployment_scope == "default"
    assert load(FrontConfig, ["--isvc", "llama"], {"POD_NAMESPACE": "ml"}).deployment_scope == "ml.llama"
    assert load(FrontConfig, ["--isvc", "llama"], {"PDSERVE_SCOPE": "local-1"}).deployment_scope == "local-1"


def test_dtype_auto_is_float32_on_the_cpu(monkeypatch):
    """On a CPU without native bfloat16 (AVX512-BF16, AMX); with it, see test_engine_checkpoint."""
    import torch

    from pdserve import checkpoint
    from pdserve.checkpoint import resolve_dtype

    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16 and resolve_dtype("float16", "cuda") is torch.float16


@pytest.mark.slow  # a worker process importing torch: several seconds, more on a busy machine
@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_cuda_worker_without_cuda_refuses_to_start(command):
    """A pool given GPUs renders --device cuda; where no GPU is visible the worker exits at once
    with a message saying so (its pod then stays NotReady), before loading any model."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-P", "-m", "pdserve.cli", command, "--device", "cuda", "--model", "/nonexistent"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    assert "--device cuda: CUDA is not available here" in r.stderr, r.stderr
    assert "/nonexistent" not in r.stderr, "the device is checked before the model is looked for"

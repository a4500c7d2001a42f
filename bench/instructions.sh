#!/usr/bin/env bash
# Callgrind instructions per operation of a source tree: the client (bench/client_cpu.py conc and occ64,
# inline), the server's append path (bench/server_path.py), the server with its transport (bench/server_tcp.py:
# real sockets to the client and to three storage nodes, conc and seq) and the storage node
# (bench/storage_append.py --callgrind). Instruction counts do not drift with the machine's load, so two trees compare run by run.
# Each client and server figure runs a fixed amount of work at N and 3N and divides the difference (start-up
# cancels). Usage: bench/instructions.sh [SRC_TREE] [OUTDIR]   (default: this tree, a temp dir)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(cd "${1:-$ROOT}" && pwd)
OUT=${2:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PY:-$ROOT/.venv/bin/python}
export PYTHONPATH=$SRC/src
cd "$SRC"
total() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'; }
cg() { local out=$1; shift; valgrind --tool=callgrind --callgrind-out-file="$out" "$@" >"$out.log" 2>&1; }
# (Arguments of cg before the interpreter are valgrind's: e.g. --instr-atstart=no.)
for phase in conc occ64; do
  cg "$OUT/client-$phase-1000.cg" "$PY" bench/client_cpu.py --count 1000 --phase $phase
  cg "$OUT/client-$phase-3000.cg" "$PY" bench/client_cpu.py --count 3000 --phase $phase
  a=$(total "$OUT/client-$phase-1000.cg"); b=$(total "$OUT/client-$phase-3000.cg")
  echo "client $phase: $(((b - a) / 2000)) instructions per append"
done
cg "$OUT/server-2000.cg" "$PY" bench/server_path.py --appends 2000 --ack-ms 100 --repeat 1
cg "$OUT/server-6000.cg" "$PY" bench/server_path.py --appends 6000 --ack-ms 100 --repeat 1
a=$(total "$OUT/server-2000.cg"); b=$(total "$OUT/server-6000.cg")
echo "server: $(((b - a) / 4000)) instructions per append"
# The client and the storage nodes of server_tcp.py are exec'd children: valgrind counts the server alone,
# and only from the client's connection to its last append (its start-up varies more than an append costs).
for spec in conc:2000 seq:500; do
  phase=${spec%:*}; n=${spec#*:}
  for m in $n $((3 * n)); do
    cg "$OUT/server-tcp-$phase-$m.cg" --instr-atstart=no "$PY" bench/server_tcp.py --phase $phase --appends $m \
      --callgrind-toggle
  done
  a=$(total "$OUT/server-tcp-$phase-$n.cg"); b=$(total "$OUT/server-tcp-$phase-$((3 * n)).cg")
  echo "server with transport, $phase: $(((b - a) / (2 * n))) instructions per append"
done
# On a tmpfs no fsync is slow, so none goes to a thread (which costs far more instructions): comparable runs.
SHM=$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)
"$PY" bench/storage_append.py --dir "$SHM" --modes batched --batch 29 --batch-in-flight 1 --records 5800 \
  --callgrind "$OUT/storage.cg" >"$OUT/storage.log" 2>&1
echo "storage node: $(($(total "$OUT/storage.cg") / 200)) instructions per 29-record request"
rm -rf "$SHM"
grep -o '([0-9]* fsynced in a thread)' "$OUT/storage.log" || true
echo "callgrind files in $OUT"

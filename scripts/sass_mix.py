#!/usr/bin/env python
"""SASS instruction mix of a kernel's steady-state key-block loop, per class and per attention score.

    python scripts/sass_mix.py FILE --list [--grep RE]              # kernels in a cubin / ELF / .so, registers
    python scripts/sass_mix.py FILE --kernel RE [--json OUT]        # loops of the one kernel matching RE
    python scripts/sass_mix.py dump.sass [--loop 0x2540]            # SASS text (cuobjdump -sass or nvdisasm)
    python scripts/sass_mix.py --leanfa fp8 [--env LEANFA_HOPPER_X=1]  # compile leanfa's d128 causal, then as above
    python scripts/sass_mix.py --compare a.json b.json@0x8b10       # per-score classes side by side

A binary is disassembled with ``cuobjdump -sass -fun`` (found on PATH, under /usr/local/cuda*/bin, or in Triton's
bundled ``backends/nvidia/bin``); RE is searched in the demangled name (``c++filt``). Basic blocks come from the
branch targets; loops are natural loops (a branch u -> h where h dominates u), so the out-of-line mbarrier retry
blocks ptxas puts at the end of a kernel, which jump back into a loop, are not loops themselves. For each innermost
loop the *path* is the shortest header-to-back-edge path through the loop's blocks: the iteration in which no wait
spins and no optional block (a causal mask, say) runs; blocks of the loop off that path are listed as skipped.

Scores per thread and iteration: wgmma instructions on the path are grouped into chains (consecutive, same
accumulator, restarted by a zero accumulator ``RZ``); the PV chain's summed K is the block's keys (PV: the chain
whose A operand is in registers, else the one whose K equals the other chains' summed N), and its 64 rows x keys
over a warpgroup's 128 threads give the scores per thread. The number of ``MUFU.EX2`` on the path is printed next to it (one per score plus a few per row).
"""

from __future__ import annotations

import argparse
import glob
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field

#: instruction classes, by opcode (the part before the first '.'; MUFU, F2FP etc. keep their subtype in the
#: event list). First match wins; anything unmatched is "other".
CLASSES = (
    ("mufu", ("MUFU",)),
    ("ffma/fmul/fadd", ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2")),
    ("fmnmx", ("FMNMX", "HMNMX2")),
    ("fsel/fsetp", ("FSEL", "FSETP", "FSET", "FCHK")),
    ("cvt/prmt", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND", "PRMT", "UPRMT")),
    ("shfl", ("SHFL",)),
    ("sync", ("BAR", "DEPBAR", "SYNCS", "WARPGROUP", "MEMBAR", "ERRBAR", "ARRIVES", "FENCE", "WARPSYNC", "CCTL")),
    ("gmma", ("HGMMA", "QGMMA", "IGMMA", "BGMMA")),
    ("ld/st", ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LD", "ST", "LDL", "STL", "LDC", "ULDC", "ATOM", "ATOMS",
               "ATOMG", "RED", "REDG", "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "LDGSTS")),
    ("uniform", ("UIADD3", "UIMAD", "UMOV", "ULEA", "USHF", "ULOP3", "UISETP", "USEL", "USGXT", "UFLO", "UPOPC",
                 "UBREV", "UBMSK", "ULOP", "ULOP32I", "UIMNMX", "UPLOP3", "UP2UR", "UR2UP", "USETMAXREG", "VOTEU",
                 "S2UR", "UCLEA", "UVIADD")),
    ("int/addr", ("IMAD", "IADD3", "IADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA", "ISETP", "SEL", "IMNMX", "VIADD",
                  "VIMNMX", "MOV", "IABS", "POPC", "FLO", "BREV", "BMSK", "SGXT", "S2R", "CS2R", "R2UR", "P2R", "R2P",
                  "PLOP3", "VOTE", "IMUL", "ELECT", "MATCH", "LEPC")),
    ("control", ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "NOP", "YIELD", "KILL",
                 "BMOV", "NANOSLEEP", "WARPSYNC.ALL")),
)
CLASS_NAMES = tuple(c for c, _ in CLASSES) + ("other",)
_CLASS_OF = {op: c for c, ops in CLASSES for op in ops}
BRANCHES = {"BRA", "BRX", "JMP", "JMX", "RET", "EXIT", "BREAK"}
GMMA_SHAPE = re.compile(r"^[HQIB]GMMA\.(\d+)x(\d+)x(\d+)")
THREADS_PER_WARPGROUP = 128
ROOT = -1  # the control-flow graph's virtual entry block

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")  # "/*0a30*/   @!P0 BRA 0x170 ;"
_LABEL = re.compile(r"^\s*(\.L[\w.$]*):")  # nvdisasm labels
_FUNC = re.compile(r"^\s*(?:Function\s*:\s*|\.text\.)(\S+?):?\s*$")


def classify(opcode: str) -> str:
    base = opcode.split(".")[0]
    return _CLASS_OF.get(base, "other")


@dataclass
class Instr:
    addr: int
    pred: str  # "" or e.g. "!P0"
    opcode: str  # with modifiers, e.g. "MUFU.EX2"
    operands: str
    target: int | None = None  # branch target

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def cls(self) -> str:
        return classify(self.opcode)

    @property
    def conditional(self) -> bool:
        return self.pred not in ("", "PT")


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Functions of a ``cuobjdump -sass`` / ``nvdisasm`` listing: name -> instructions in address order."""
    funcs: dict[str, list[Instr]] = {}
    name, labels, pending, raw = "<anonymous>", {}, [], []
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m and not _LINE.match(line):
            if raw:
                funcs[name] = _resolve(raw, labels)
            name, labels, pending, raw = m.group(1), {}, [], []
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        addr, body = int(m.group(1), 16), m.group(2).strip()
        for lab in pending:
            labels[lab] = addr
        pending = []
        pred = ""
        if body.startswith("@"):
            pred, body = body[1:].split(None, 1)
        parts = body.split(None, 1)
        raw.append((addr, pred, parts[0], parts[1] if len(parts) > 1 else ""))
    if raw:
        funcs[name] = _resolve(raw, labels)
    return funcs


def _resolve(raw, labels) -> list[Instr]:
    out = []
    for addr, pred, op, rest in raw:
        ins = Instr(addr, pred, op, rest)
        if ins.base in ("BRA", "JMP", "CALL", "BREAK") or ins.base == "BSSY":
            m = re.search(r"`\((\.L[\w.$]*)\)", rest)
            if m and m.group(1) in labels:
                ins.target = labels[m.group(1)]
            else:
                hexes = re.findall(r"0x[0-9a-f]+", rest)
                ins.target = int(hexes[-1], 16) if hexes else None
        if ins.base == "BSSY":  # a convergence point, not a jump
            ins.target = None
        out.append(ins)
    return out


# ----------------------------------------------------------------------------- control flow


@dataclass
class CFG:
    instrs: list[Instr]
    starts: list[int]  # instruction index where each block starts
    succ: dict[int, list[int]]  # block id -> successor block ids
    pred: dict[int, list[int]] = field(default_factory=dict)

    def block_instrs(self, b: int) -> list[Instr]:
        end = self.starts[b + 1] if b + 1 < len(self.starts) else len(self.instrs)
        return self.instrs[self.starts[b]:end]

    def addr(self, b: int) -> int:
        return self.instrs[self.starts[b]].addr


def build_cfg(instrs: list[Instr]) -> CFG:
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, ins in enumerate(instrs):
        if ins.base in BRANCHES:
            if ins.target is not None and ins.target in index:
                leaders.add(index[ins.target])
            if i + 1 < len(instrs):
                leaders.add(i + 1)
    starts = sorted(leaders)
    block_of = {s: b for b, s in enumerate(starts)}
    succ: dict[int, list[int]] = {}
    for b, s in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else len(instrs)
        last = instrs[end - 1]
        nxt = [block_of[end]] if end < len(instrs) else []
        if last.base in BRANCHES:
            tgt = [block_of[index[last.target]]] if last.target is not None and last.target in index else []
            succ[b] = tgt + (nxt if last.conditional else [])
        else:
            succ[b] = nxt
    # A virtual root (-1) enters at the first block and at every block nothing branches to: the targets of an
    # indirect branch (BRX through a jump table, as in a warp-specialized kernel's partition dispatch).
    targeted = {s for ss in succ.values() for s in ss}
    succ[ROOT] = [0] + [b for b in range(1, len(starts)) if b not in targeted]
    cfg = CFG(instrs, starts, succ)
    while True:
        seen = set(_rpo(cfg, ROOT))
        rest = [b for b in range(len(starts)) if b not in seen]
        if not rest:
            break
        succ[ROOT].append(rest[0])  # only reachable through a cycle from an indirect target
    pred = defaultdict(list)
    for b, ss in succ.items():
        for s in ss:
            pred[s].append(b)
    cfg.pred = dict(pred)
    return cfg


def _rpo(cfg: CFG, entry: int) -> list[int]:
    seen, order, stack = {entry}, [], [(entry, iter(cfg.succ[entry]))]
    while stack:
        node, it = stack[-1]
        for s in it:
            if s not in seen:
                seen.add(s)
                stack.append((s, iter(cfg.succ[s])))
                break
        else:
            order.append(node)
            stack.pop()
    return order[::-1]


def dominators(cfg: CFG) -> dict[int, int]:
    """Immediate dominators of the blocks reachable from the entry (Cooper, Harvey and Kennedy's iteration)."""
    order = _rpo(cfg, ROOT)
    pos = {b: i for i, b in enumerate(order)}
    idom = {order[0]: order[0]}

    def meet(a, b):
        while a != b:
            while pos[a] > pos[b]:
                a = idom[a]
            while pos[b] > pos[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in order[1:]:
            ps = [p for p in cfg.pred.get(b, []) if p in idom]
            new = ps[0]
            for p in ps[1:]:
                new = meet(p, new)
            if idom.get(b) != new:
                idom[b], changed = new, True
    return idom


def _dominates(idom, h, u) -> bool:
    while True:
        if u == h:
            return True
        if idom[u] == u:
            return False
        u = idom[u]


@dataclass
class Loop:
    header: int  # block ids
    latches: list[int]
    body: set[int]


def natural_loops(cfg: CFG) -> list[Loop]:
    idom = dominators(cfg)
    loops: dict[int, Loop] = {}
    for u in idom:
        if u == ROOT:
            continue
        for h in cfg.succ[u]:
            if h in idom and _dominates(idom, h, u):
                lp = loops.setdefault(h, Loop(h, [], {h}))
                lp.latches.append(u)
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in lp.body:
                        lp.body.add(x)
                        stack.extend(cfg.pred.get(x, []))
    return sorted(loops.values(), key=lambda lp: cfg.addr(lp.header))


def innermost(loops: list[Loop]) -> list[Loop]:
    return [lp for lp in loops if not any(o is not lp and o.header in lp.body for o in loops)]


def nests(lp: Loop, loops: list[Loop]) -> bool:
    return any(o is not lp and o.header in lp.body for o in loops)


def shortest_path(cfg: CFG, lp: Loop) -> list[int]:
    """Fewest-instruction block path from the header to a latch through the loop's blocks (Dijkstra; the back
    edges to the header are not taken, inner spin-wait cycles never shorten a path)."""
    best = {lp.header: (len(cfg.block_instrs(lp.header)), [lp.header])}
    heap, done = [(best[lp.header][0], lp.header)], set()
    while heap:
        cost, b = heapq.heappop(heap)
        if b in done:
            continue
        done.add(b)
        for s in cfg.succ[b]:
            if s in lp.body and s != lp.header:
                c = cost + len(cfg.block_instrs(s))
                if s not in best or c < best[s][0]:
                    best[s] = (c, best[b][1] + [s])
                    heapq.heappush(heap, (c, s))
    return min((best[la] for la in lp.latches if la in best), key=lambda t: t[0])[1]


def is_spin(cfg: CFG, lp: Loop) -> bool:
    """A retry loop around a wait: a few instructions, one of them a barrier/mbarrier wait or sleep."""
    body = [i for b in lp.body for i in cfg.block_instrs(b)]
    return len(body) <= 8 and any(i.cls == "sync" or i.base == "NANOSLEEP" for i in body)


# ----------------------------------------------------------------------------- per-loop mix


def gmma_chains(instrs: list[Instr]) -> list[dict]:
    """Consecutive wgmma instructions into one accumulator: shape, count, summed K, A from registers or smem."""
    chains: list[dict] = []
    for ins in instrs:
        m = GMMA_SHAPE.match(ins.opcode)
        if not m:
            continue
        ops = [o.strip() for o in ins.operands.split(",")]
        dst, zero = ops[0], len(ops) > 2 and ops[2] == "RZ" or len(ops) > 3 and ops[3] == "RZ"
        M, N, K = (int(x) for x in m.groups())
        last = chains[-1] if chains else None
        if last is None or last["acc"] != dst or zero or last["shape"] != (M, N):
            chains.append(dict(op=ins.opcode, shape=(M, N), k=0, n_instr=0, acc=dst,
                               a_regs=not ops[1].startswith("gdesc"), first=hex(ins.addr)))
            last = chains[-1]
        last["k"] += K
        last["n_instr"] += 1
    return chains


def scores_per_thread(chains: list[dict]) -> tuple[int | None, list[dict]]:
    """Scores per thread and iteration from the PV chain(s): their summed K is the block's keys, M its rows.
    PV is the chain whose A comes from registers (P through registers); with every A from shared memory, the
    chain whose K equals the other chains' summed N (the QK chains' N are the keys)."""
    pv = [c for c in chains if c["a_regs"]]
    if not pv:
        pv = [c for c in chains if c["k"] == sum(o["shape"][1] for o in chains if o is not c)][-1:]
    if not pv:
        return None, []
    return sum(c["shape"][0] * c["k"] for c in pv) // THREADS_PER_WARPGROUP, pv


def loop_mix(cfg: CFG, lp: Loop, scores: int | None = None) -> dict:
    path = shortest_path(cfg, lp)
    instrs = [ins for b in path for ins in cfg.block_instrs(b)]
    lo, hi = cfg.addr(lp.header), max(cfg.block_instrs(la)[-1].addr for la in lp.latches)
    counts = Counter(ins.cls for ins in instrs)
    chains = gmma_chains(instrs)
    inferred, pv = scores_per_thread(chains)
    scores = scores or inferred
    ex2 = sum(ins.opcode.startswith("MUFU.EX2") for ins in instrs)
    skipped = []
    for b in sorted(lp.body - set(path), key=cfg.addr):
        bi = cfg.block_instrs(b)
        skipped.append(dict(start=hex(bi[0].addr), end=hex(bi[-1].addr), n=len(bi),
                            inline=lo <= bi[0].addr <= hi, mix=dict(Counter(i.cls for i in bi))))
    events, i = [], 0
    while i < len(instrs):  # waits, barriers and wgmma in issue order (a wgmma run folded into one entry)
        ins = instrs[i]
        if ins.cls == "gmma":
            acc, n, last, j = ins.operands.split(",")[0], 1, i, i + 1
            while j < len(instrs) and instrs[j].cls != "sync":
                if instrs[j].cls == "gmma":
                    if instrs[j].operands.split(",")[0] != acc:
                        break
                    n, last = n + 1, j
                j += 1
            events.append(f"#{i}-{last} {n}x {ins.opcode} {acc}")
            i = last + 1
            continue
        if ins.cls == "sync" or ins.opcode.startswith("LDG"):
            arg = f" {ins.operands}" if ins.base in ("BAR", "WARPGROUP") and ins.operands else ""
            events.append(f"#{i} {('@' + ins.pred + ' ') if ins.pred else ''}{ins.opcode}{arg}")
        i += 1
    return dict(header=hex(lo), latch=hex(hi), inline=sum(1 for x in cfg.instrs if lo <= x.addr <= hi),
                path=len(instrs), blocks=len(lp.body), scores=scores, scores_from=(
                    "PV: " + " + ".join(f"{c['shape'][0]} rows x {c['k']} keys" for c in pv)
                    + f" / {THREADS_PER_WARPGROUP} threads" if pv and scores == inferred else "given"),
                mufu_ex2=ex2, classes={c: counts.get(c, 0) for c in CLASS_NAMES},
                per_score={c: round(counts.get(c, 0) / scores, 3) for c in CLASS_NAMES} if scores else None,
                opcodes=dict(Counter(ins.opcode for ins in instrs).most_common()),
                chains=[{k: v for k, v in c.items() if k != "acc"} for c in chains], events=events, skipped=skipped)


def analyze(instrs: list[Instr], scores: int | None = None, only: int | None = None) -> dict:
    """Every natural loop (spin waits only counted), and the mix of each steady-state loop: one holding wgmma and
    MUFU.EX2 with no such loop inside it (or the loop whose header address is ``only``)."""
    cfg = build_cfg(instrs)
    loops = natural_loops(cfg)
    spins = [lp for lp in loops if is_spin(cfg, lp)]
    summary, work = [], {}
    for lp in loops:
        if lp in spins:
            continue
        body = [ins for b in lp.body for ins in cfg.block_instrs(b)]
        work[lp.header] = any(i.cls == "gmma" for i in body) and any(i.opcode.startswith("MUFU.EX2") for i in body)
        summary.append(dict(header=hex(cfg.addr(lp.header)), blocks=len(lp.body), instrs=len(body),
                            gmma=sum(i.cls == "gmma" for i in body),
                            mufu_ex2=sum(i.opcode.startswith("MUFU.EX2") for i in body)))
    working = [lp for lp in loops if work.get(lp.header)]
    steady = [loop_mix(cfg, lp, scores) for lp in loops
              if (only is None and lp in working and not nests(lp, working)) or only == cfg.addr(lp.header)]
    setmaxnreg = sorted({("dealloc " if "DEALLOC" in i.opcode else "alloc ") + str(int(i.operands.split()[-1], 16))
                         for i in instrs if i.base == "USETMAXREG"})
    return dict(instructions=len(instrs), setmaxnreg=setmaxnreg, spin_loops=len(spins), loops=summary,
                steady=steady)


# ----------------------------------------------------------------------------- tools and binaries


def find_tool(name: str) -> str:
    cands = [shutil.which(name)] + sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))
    try:
        import triton
        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except ImportError:
        pass
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    raise SystemExit(f"{name} not found (PATH, /usr/local/cuda*/bin, triton/backends/nvidia/bin)")


def demangle(names: list[str]) -> list[str]:
    if not names or not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def list_kernels(path: str) -> list[dict]:
    """Kernels of a cubin / ELF / .so with their registers at launch (``cuobjdump -res-usage``)."""
    txt = subprocess.run([find_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    rows, name = [], None
    for line in txt.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            rows.append(dict(mangled=name, regs=int(m.group(1)), stack=int(m.group(2)), local=int(m.group(4))))
            name = None
    for r, d in zip(rows, demangle([r["mangled"] for r in rows])):
        r["name"] = d
    return rows


def compile_leanfa(dtype: str, env: list[str], out_dir: str) -> str:
    """Compile leanfa's d128 causal Hopper kernel for sm90 on the CPU (:mod:`leanfa.kernels.hopper.gluon_aot`,
    as ``scripts/hopper_compile_check.py`` does; ``env``: ``LEANFA_HOPPER_*=value`` experiment knobs) and write
    its cubin; returns the path."""
    from unittest import mock

    import triton

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from leanfa.kernels.hopper import gluon_aot

    got = {}
    real = triton.compile

    def keep(*args, **kw):
        got["kernel"] = real(*args, **kw)
        return got["kernel"]

    knobs = tuple(tuple(e.split("=", 1)) for e in env)
    with mock.patch.object(triton, "compile", keep):
        name = gluon_aot.compile_variant(gluon_aot.Variant(dtype, 128, 128, True, env=knobs)).name
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, re.sub(r"[^\w.=-]+", "_", name) + ".cubin")
    with open(path, "wb") as f:
        f.write(got["kernel"].asm["cubin"])
    return path


def kernel_sass(path: str, mangled: str) -> str:
    return subprocess.run([find_tool("cuobjdump"), "-sass", "-fun", mangled, path], capture_output=True,
                          text=True).stdout


# ----------------------------------------------------------------------------- output


def markdown(res: dict) -> str:
    out = [f"kernel: {res.get('kernel', '?')}", f"registers at launch: {res.get('regs', '?')}; setmaxnreg: "
           f"{', '.join(res['setmaxnreg']) or 'none'}; {res['instructions']} instructions", "",
           f"natural loops (besides {res['spin_loops']} spin waits of <= 8 instructions):", "",
           "| loop header | blocks | instrs | gmma | MUFU.EX2 |", "|---|---|---|---|---|"]
    out += [f"| {lp['header']} | {lp['blocks']} | {lp['instrs']} | {lp['gmma']} | {lp['mufu_ex2']} |"
            for lp in res["loops"]]
    for s in res["steady"]:
        out += ["", f"### loop {s['header']}..{s['latch']}: {s['inline']} instructions in line, {s['path']} on the "
                f"shortest path; {s['scores']} scores/thread/iteration ({s['scores_from']}), "
                f"{s['mufu_ex2']} MUFU.EX2", "",
                "| class | per iteration | per score |", "|---|---|---|"]
        for c in CLASS_NAMES:
            if s["classes"][c]:
                ps = f"{s['per_score'][c]:.3f}" if s["per_score"] else "-"
                out.append(f"| {c} | {s['classes'][c]} | {ps} |")
        tot = s["path"] / s["scores"] if s["scores"] else 0
        out.append(f"| **total** | {s['path']} | {tot:.3f} |")
        out += ["", "wgmma chains: " + "; ".join(
            f"{c['n_instr']}x {c['op']} (K={c['k']}, A from {'registers' if c['a_regs'] else 'smem'})"
            for c in s["chains"]), "events: " + " | ".join(s["events"])]
        if s["skipped"]:
            out.append("off the path: " + "; ".join(
                f"{k['start']}..{k['end']} ({k['n']}{'' if k['inline'] else ', out of line'}: "
                + ", ".join(f"{c} {n}" for c, n in sorted(k["mix"].items(), key=lambda t: -t[1])) + ")"
                for k in s["skipped"]))
    return "\n".join(out)


def compare(specs: list[str]) -> str:
    cols = []
    for spec in specs:
        path, _, at = spec.partition("@")
        res = json.load(open(path))
        loops = [s for s in res["steady"] if not at or int(s["header"], 16) == int(at, 16)]
        if not loops:
            raise SystemExit(f"{spec}: no such steady loop")
        cols.append((os.path.basename(path) + (f"@{at}" if at else ""), loops[0]))
    out = ["| class | " + " | ".join(n for n, _ in cols) + " |", "|---|" + "---|" * len(cols)]
    for c in CLASS_NAMES + ("total",):
        vals = [(s["path"] if c == "total" else s["classes"][c]) / s["scores"] for _, s in cols]
        if any(vals):
            out.append(f"| {c} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    out.append("| scores/thread/iter | " + " | ".join(str(s["scores"]) for _, s in cols) + " |")
    out.append("| MUFU.EX2/iter | " + " | ".join(str(s["mufu_ex2"]) for _, s in cols) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?")
    ap.add_argument("--list", action="store_true", help="list the kernels (with --grep RE: those matching)")
    ap.add_argument("--grep", default="")
    ap.add_argument("--kernel", action="append", default=[], help="regex on the demangled name (repeat: all match)")
    ap.add_argument("--loop", default=None, help="analyse the loop with this header address only")
    ap.add_argument("--scores", type=int, default=None, help="scores per thread per iteration (else inferred)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--leanfa", choices=("fp8", "bf16"), help="compile leanfa's d128 causal Hopper kernel (no FILE)")
    ap.add_argument("--env", action="append", default=[], help="with --leanfa: LEANFA_HOPPER_X=value (repeat)")
    ap.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "sass_mix"),
                    help="with --leanfa: where the cubin goes")
    ap.add_argument("--compare", nargs="+", default=None, help="JSON[@HEADER] files: per-score classes side by side")
    a = ap.parse_args(argv)
    if a.compare:
        print(compare(a.compare))
        return 0
    if not a.file and not a.leanfa:
        ap.error("FILE (or --leanfa) is needed")
    only = int(a.loop, 16) if a.loop else None
    if a.leanfa:
        a.file = compile_leanfa(a.leanfa, a.env, a.out_dir)
        print(f"cubin: {a.file}")
    if a.file.endswith((".sass", ".txt")):
        funcs = parse_sass(open(a.file).read())
        picked = [n for n in funcs if all(re.search(k, n) for k in a.kernel)]
        if len(picked) != 1:
            raise SystemExit(f"{len(picked)} functions match: {', '.join(picked) or '-'}")
        res = dict(kernel=picked[0], **analyze(funcs[picked[0]], a.scores, only))
    else:
        rows = list_kernels(a.file)
        if a.list:
            for i, r in enumerate(rows):
                if re.search(a.grep, r["name"]):
                    print(f"{i:4d} regs={r['regs']:3d} stack={r['stack']:4d}  {r['name']}")
            return 0
        picked = [r for r in rows if all(re.search(k, r["name"]) or re.search(k, r["mangled"]) for k in a.kernel)]
        if len(picked) != 1 and not a.kernel and len(rows) == 1:
            picked = rows
        if len(picked) != 1:
            raise SystemExit(f"{len(picked)} kernels match --kernel (need 1); try --list --grep"
                             + "".join(f"\n  {r['name'][:300]}" for r in picked[:10]))
        r = picked[0]
        funcs = parse_sass(kernel_sass(a.file, r["mangled"]))
        res = dict(kernel=r["name"], mangled=r["mangled"], regs=r["regs"],
                   **analyze(funcs[r["mangled"]], a.scores, only))
    print(markdown(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/sass_mix.py on hand-written SASS: classes, loop detection (natural loops, not the out-of-line retry
blocks that jump back into a loop), the shortest path past an optional mask block, scores per thread."""

import importlib.util
import os
import sys

import pytest

_spec = importlib.util.spec_from_file_location(
    "sass_mix", os.path.join(os.path.dirname(__file__), "..", "scripts", "sass_mix.py"))
sm = importlib.util.module_from_spec(_spec)
sys.modules["sass_mix"] = sm  # (dataclasses look their module up)
_spec.loader.exec_module(sm)

# One key-block loop (header 0x30, back edge at 0x190): a K wait whose retry block sits out of line at 0x1c0 and
# jumps back into the loop (0x50), QK = 2 x HGMMA.64x16x16 (16 keys, K = 32) from shared memory, PV = 1 x
# HGMMA.64x32x16 with P from registers (K = 16 keys), a causal-mask block (0xa0..0xc0) skipped by a branch,
# and 9 exponentials (8 scores + 1 rescale).
TOY = """
\tcode for sm_90
\t\tFunction : toy_kernel
        /*0000*/                   S2R R0, SR_TID.X ;                       /* 0x0000000000007919 */
                                                                            /* 0x000e220000002100 */
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x80, PT ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x100], R2 ;
        /*0040*/              @!P1 BRA 0x1c0 ;
        /*0050*/                   WARPGROUP.ARRIVE ;
        /*0060*/                   HGMMA.64x16x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0070*/                   HGMMA.64x16x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0090*/              @!P2 BRA 0xd0 ;
        /*00a0*/                   ISETP.GT.AND P3, PT, R4, R5, PT ;
        /*00b0*/                   FSEL R24, R24, -INF , !P3 ;
        /*00c0*/                   FSEL R25, R25, -INF , !P3 ;
        /*00d0*/                   FMNMX R6, R24, R25, !PT ;
        /*00e0*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;
        /*00f0*/                   FFMA R24, R24, UR5, -R6 ;
        /*0100*/                   MUFU.EX2 R24, R24 ;
        /*0110*/                   MUFU.EX2 R25, R25 ;
        /*0120*/                   MUFU.EX2 R26, R26 ;
        /*0130*/                   MUFU.EX2 R27, R27 ;
        /*0140*/                   MUFU.EX2 R28, R28 ;
        /*0150*/                   MUFU.EX2 R29, R29 ;
        /*0160*/                   MUFU.EX2 R30, R30 ;
        /*0170*/                   MUFU.EX2 R31, R31 ;
        /*0180*/                   MUFU.EX2 R8, R8 ;
        /*0188*/                   F2FP.BF16.F32.PACK_AB R30, R25, R24 ;
        /*018c*/                   PRMT R31, R26, 0x5410, R27 ;
        /*018e*/                   FMUL R40, R40, R8 ;
        /*018f*/                   HGMMA.64x32x16.F32.BF16 R40, R30, gdesc[UR16], R40, gsb0 ;
        /*0190*/                   UIADD3 UR4, UR4, 0x8, URZ ;
        /*0191*/                   IADD3 R9, R9, 0x1, RZ ;
        /*0192*/                   LDG.E R10, desc[UR6][R12.64] ;
        /*0193*/                   ISETP.NE.AND P4, PT, R9, R11, PT ;
        /*0194*/               @P4 BRA 0x30 ;
        /*01a0*/                   EXIT ;
        /*01b0*/                   BRA 0x1b0 ;
        /*01c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x100], R2 ;
        /*01d0*/              @!P1 BRA 0x1c0 ;
        /*01e0*/                   BRA 0x50 ;
"""


def _toy():
    return sm.parse_sass(TOY)["toy_kernel"]


@pytest.mark.parametrize("opcode,cls", [
    ("MUFU.EX2", "mufu"), ("FFMA.FTZ", "ffma/fmul/fadd"), ("FADD", "ffma/fmul/fadd"), ("FMNMX.FTZ", "fmnmx"),
    ("FSEL", "fsel/fsetp"), ("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C", "cvt/prmt"), ("PRMT", "cvt/prmt"),
    ("SHFL.IDX", "shfl"), ("BAR.SYNC.DEFER_BLOCKING", "sync"), ("SYNCS.PHASECHK.TRANS64.TRYWAIT", "sync"),
    ("WARPGROUP.DEPBAR.LE", "sync"), ("QGMMA.64x224x32.F32.E4M3.E4M3", "gmma"), ("HGMMA.64x128x16.F32.BF16", "gmma"),
    ("LDG.E", "ld/st"), ("STSM.16.M88.4", "ld/st"), ("UIADD3.64", "uniform"), ("IMAD.MOV.U32", "int/addr"),
    ("SEL", "int/addr"), ("BRA", "control"), ("NOP", "control"), ("VOTEU.ANY", "uniform"), ("POPC", "int/addr"),
    ("XYZZY", "other"),
])
def test_classify(opcode, cls):
    assert sm.classify(opcode) == cls


def test_parse_predicates_and_targets():
    ins = {i.addr: i for i in _toy()}
    assert len(ins) == 39
    assert (ins[0x40].pred, ins[0x40].opcode, ins[0x40].target) == ("!P1", "BRA", 0x1c0)
    assert ins[0x194].target == 0x30 and ins[0x194].conditional
    assert ins[0x1e0].target == 0x50 and not ins[0x1e0].conditional
    assert ins[0x20].base == "EXIT" and ins[0x20].conditional


def test_loops_are_natural():
    instrs = _toy()
    cfg = sm.build_cfg(instrs)
    headers = sorted(cfg.addr(lp.header) for lp in sm.natural_loops(cfg))
    # the retry block's spin (0x1c0) and the end-of-code self-branch (0x1b0) are loops; the retry block's jump
    # back to 0x50 is not (0x50 does not dominate it)
    assert headers == [0x30, 0x1b0, 0x1c0]
    spin = [lp for lp in sm.natural_loops(cfg) if cfg.addr(lp.header) == 0x1c0][0]
    assert sm.is_spin(cfg, spin)


def test_steady_loop_mix():
    res = sm.analyze(_toy())
    assert res["spin_loops"] == 1 and [lp["header"] for lp in res["loops"]] == ["0x30", "0x1b0"]
    (s,) = res["steady"]
    assert (s["header"], s["latch"]) == ("0x30", "0x194")
    assert s["inline"] == 31 and s["path"] == 28  # the mask block's 3 instructions are off the shortest path
    assert s["scores"] == 8 and s["mufu_ex2"] == 9  # PV: 64 rows x 16 keys / 128 threads
    want = {"mufu": 9, "ffma/fmul/fadd": 2, "fmnmx": 1, "fsel/fsetp": 0, "cvt/prmt": 2, "shfl": 1, "sync": 3,
            "gmma": 3, "ld/st": 1, "uniform": 1, "int/addr": 2, "control": 3, "other": 0}
    assert s["classes"] == want and sum(want.values()) == s["path"]
    assert s["per_score"]["mufu"] == pytest.approx(9 / 8, abs=1e-3)
    chains = [(c["shape"], c["k"], c["n_instr"], c["a_regs"]) for c in s["chains"]]
    assert chains == [((64, 16), 32, 2, False), ((64, 32), 16, 1, True)]
    skipped = {k["start"]: (k["n"], k["inline"]) for k in s["skipped"]}
    assert skipped == {"0xa0": (3, True), "0x1c0": (2, False), "0x1e0": (1, False)}
    md = sm.markdown(dict(kernel="toy", **res))
    assert "| mufu | 9 | 1.125 |" in md and "| **total** | 28 | 3.500 |" in md


def test_nvdisasm_labels_and_indirect_entries():
    """nvdisasm's label syntax; a loop reached only through an indirect branch (BRX jump table) is found."""
    text = """
        .text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   BRX R2 -0x20 ;
        /*0020*/                   EXIT ;
.L_x_1:
        /*0030*/                   MUFU.EX2 R4, R4 ;
        /*0040*/                   HGMMA.64x8x16.F32.BF16 R8, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0050*/                   HGMMA.64x16x16.F32.BF16 R12, R6, gdesc[UR8], R12, gsb0 ;
        /*0060*/              @P0 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""
    funcs = sm.parse_sass(text)
    assert list(funcs) == ["k"]
    instrs = funcs["k"]
    assert instrs[6].target == 0x30
    res = sm.analyze(instrs)
    (s,) = res["steady"]
    assert (s["header"], s["latch"], s["path"]) == ("0x30", "0x60", 4)
    assert s["scores"] == 8  # PV chain: 64 rows x 16 keys


def test_scores_when_p_goes_through_shared_memory():
    """Both wgmma chains read A from shared memory: PV is the chain whose K is the other chains' summed N
    (here two 64x128 QK halves of a 256-key block)."""
    chains = [dict(shape=(64, 128), k=128, a_regs=False), dict(shape=(64, 128), k=128, a_regs=False),
              dict(shape=(64, 128), k=256, a_regs=False)]
    scores, pv = sm.scores_per_thread(chains)
    assert scores == 128 and pv == [chains[2]]

"""``zckpt convert <Megatron MoE save> --to megatron --ep N``: Megatron-Core mixture-of-experts checkpoints (the real
fixtures/megatron/moe16_* of megatron-core 0.16.1 and moe19_* of 0.19.2, SequentialMLP experts, 8 per layer) written
as ``fully_reshardable`` for another expert-parallel size (zckpt/megatron/writer_moe.py).

The oracle: megatron-core 0.16.1 itself (tests/megatron_write_moe_worker.py, in the one launch of 2 CPU ranks that
tests/test_megatron_write.py and tests/test_megatron_from_runs.py share: ``megatron_core_loads``) builds the MoE
GPTModel, DDP and distributed optimizer at the new expert-parallel size, loads the output as Megatron-LM's
``load_checkpoint`` does, and every expert's weight, fp32 master, exp_avg and exp_avg_sq, the routers (and their
``expert_bias`` buffers), the dense weights, each parameter's group settings and Adam step and the scheduler equal
the source's oracle (Megatron-LM's own load of the fixture) bit for bit; one more iteration runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")

MEG = FIXTURES / "megatron"
# (source, --ep written, loaded at (tp, pp, dp), the loader's expert tp)
JOBS = [("moe16_ep2_dp4", 1, (1, 1, 2), 1),  # ep 2 -> 1: the experts join the dense optimizer (dp_reshardable source)
        ("moe16_ep1_dp2", 2, (1, 1, 2), 1),  # ep 1 -> 2: the experts' own optimizer appears (alltoall dispatcher)
        ("moe16_etp2_ep2_fullyresh", 1, (1, 1, 2), 1),  # dense + MoE layers, expert tp 2 -> 1, ep 2 -> 1
        ("moe16_ep2_dp2_expertbias", 1, (1, 1, 2), 1)]  # the routers' expert_bias buffers
# (moe19_ep2_dp4's output is checked by zckpt below, not loaded: its args pickle megatron-core 0.19 enums that
# 0.16.1, the suite's oracle, cannot unpickle)


def _convert(src, out, **kw):
    from zckpt.ops.convert import convert
    return convert(str(src), to="megatron", out=str(out), **kw)


def megatron_jobs(tmp: Path) -> tuple[list, None]:
    """The outputs megatron-core loads for this file (the shared launch: tests/megatron_core_loads.py)."""
    jobs = []
    for i, (src, ep, shape, etp) in enumerate(JOBS):
        out = tmp / f"{i}-{src}-ep{ep}"
        _convert(MEG / src, out, ep=ep)
        jobs.append({"source": src, "ckpt": str(out), "shape": list(shape), "ep": ep, "etp": etp})
    return jobs, None


@pytest.fixture(scope="module")
def loaded(megatron_core_loads):
    return megatron_core_loads[__name__][0]


@pytest.mark.parametrize("i", range(len(JOBS)), ids=[f"{s}-to-ep{e}" for s, e, _, _ in JOBS])
def test_megatron_core_loads_the_moe_output_at_another_ep(loaded, i):
    got = loaded[i]
    src, ep, shape, _ = JOBS[i]
    assert got["source"] == src and got["ep"] == ep and tuple(got["shape"]) == shape
    src_ep = json.loads((MEG / f"{src}.oracle.json").read_text())["expert_model_parallel_size"]
    assert src_ep != ep  # another expert-parallel size than the source's
    assert got["chained_optimizers"] == (2 if ep > 1 else 1)  # megatron-core's own optimizer at that ep
    assert got["keys_equal"], (got["missing"], got["extra"])  # every weight, master, exp_avg, exp_avg_sq
    assert got["experts"] >= 2 * 8 * 2 * 4 and not got["differ"], got["differ"]  # bit for bit, experts included
    assert got["groups_equal"], (got["groups"], got["groups_expected"])  # each parameter's group settings
    assert got["steps"] == got["steps_expected"] == [3]
    assert got["scheduler_equal"], got["scheduler"]
    assert got["iteration"] == got["iteration_expected"] == 3
    assert got["losses_finite"], got["losses"]  # one more iteration at the new ep


def _common(out: Path) -> dict:
    return torch.load(str(next(out.glob("iter_*")) / "common.pt"), weights_only=False)


def test_common_state_is_written_for_the_target_ep(tmp_path):
    """One optimizer's groups at ep 1 (the experts' group merged into the dense one of the same multipliers), the
    chain's two at ep > 1 (the experts' group is_expert_parallel); the tensors are the same files either way."""
    from zckpt.megatron.reader import load_common  # noqa: F401 (the reader reads what is written: below)
    import zckpt
    src = MEG / "moe16_ep2_dp4"
    one, two, four = (_convert(src, tmp_path / f"ep{n}", ep=n) for n in (1, 2, 4))
    c1, c2, c4 = (_common(tmp_path / f"ep{n}") for n in (1, 2, 4))
    g1 = c1["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["is_expert_parallel"]) for g in g1] == [(1.0, False), (0.0, False)]
    assert sorted(c2["optimizer"]) == [0, 1] and c2["optimizer"] == c4["optimizer"]
    assert [g["is_expert_parallel"] for g in c2["optimizer"][1]["optimizer"]["param_groups"]] == [True]
    assert all(g["step"] == 3.0 for g in g1)
    assert (vars(c1["args"])["expert_model_parallel_size"], vars(c4["args"])["expert_model_parallel_size"]) == (1, 4)
    for n in (1, 2):  # the tensors do not depend on the ep (torch.save's serialization ids aside)
        r = zckpt.diff(str(tmp_path / "ep4"), str(tmp_path / f"ep{n}"))
        assert r.tensors and all(t.status == "equal" for t in r.tensors) and not (r.only_in_a or r.only_in_b)
    assert any("--ep 1 (source 2)" in n for n in one.plan.notes) and four.plan.tp == 1
    assert (one.to_dict()["ep"], four.to_dict()["ep"]) == (1, 4)  # --json says the ep written for
    # read back by zckpt: every expert, master and moment as the source's
    back, orig = zckpt.open_checkpoint(str(tmp_path / "ep1")), zckpt.open_checkpoint(str(src))
    assert back.extra["moe_coverage"] and len(back.records) == len(orig.records)
    assert back.extra["step"] == 3 and two.plan.layout == "fully_reshardable"


@pytest.mark.parametrize("src", ["moe16_etp2_ep2_fullyresh", "moe19_ep2_dp4"])
def test_output_reads_back_equal_to_the_source(tmp_path, src):
    """zckpt diff of the source and the ep 1 output: every tensor (weights, masters, moments) equal; the one value
    that differs is the experts' param group, merged at ep 1 into the dense group of its settings."""
    import zckpt
    _convert(MEG / src, tmp_path / "o", ep=1)
    r = zckpt.diff(str(MEG / src), str(tmp_path / "o"))
    assert r.tensors and all(t.status == "equal" for t in r.tensors) and not (r.only_in_a or r.only_in_b)
    # (Megatron's names per expert, or Mixtral's fused per layer where diff names a Llama-shaped model so)
    assert sum(".mlp.experts." in t.name for t in r.tensors) >= 2 * 2 * 3
    assert [(v.name, v.a, v.b) for v in r.values if v.status != "equal"] == [("group 2", "present", None)]
    assert not any(t.status == "close" for t in r.tensors)  # bit for bit, not within a tolerance


def test_ep_megatron_core_cannot_run_is_refused(tmp_path):
    from zckpt.errors import OptionError, UnsupportedLayout
    with pytest.raises(UnsupportedLayout, match=r"8 experts do not divide into --ep 3"):
        _convert(MEG / "moe16_ep2_dp4", tmp_path / "a", ep=3)
    with pytest.raises(UnsupportedLayout, match="dp_reshardable buckets .* are not written"):
        _convert(MEG / "moe16_ep2_dp4", tmp_path / "b", ep=1, layout="dp_reshardable", dp=2)
    with pytest.raises(OptionError, match="this model has no experts"):
        _convert(MEG / "gpt_tp1_pp1_dp1", tmp_path / "c", ep=2)
    # --moe-layer-freq [0,1,1] at pp 3: stage 0 holds no MoE layer, so one optimizer there and two elsewhere at ep 2
    # (get_megatron_optimizer adds the experts' only where there are expert parameters); at ep 1 one everywhere
    with pytest.raises(UnsupportedLayout, match="stage 0 holds no MoE layer"):
        _convert(MEG / "moe16_etp2_ep2_fullyresh", tmp_path / "d", ep=2, pp=3)
    assert not any(tmp_path.iterdir())
    assert _convert(MEG / "moe16_etp2_ep2_fullyresh", tmp_path / "e", ep=1, pp=3, dry_run=True).plan.pp == 3


def test_moe_layers_from_the_args():
    from zckpt.megatron.writer_moe import moe_layers
    assert moe_layers(1, 3) == [0, 1, 2] and moe_layers(2, 4) == [0, 2] and moe_layers([0, 1, 1], 3) == [1, 2]
    assert moe_layers("([0]*1+[1]*2)", 3) is None and moe_layers([0, 1], 3) is None


def test_groups_that_cannot_merge_at_ep_1_are_refused():
    """At ep 1 the experts join the dense group of the same multipliers: an expert group whose other settings differ
    (a run that gave the experts their own lr) cannot be held, and is refused rather than merged."""
    from zckpt.errors import UnsupportedLayout
    from zckpt.megatron.writer_moe import optimizer_state
    dense = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False, "lr": 1e-3,
             "step": 3.0}
    expert = {**dense, "is_expert_parallel": True, "lr": 2e-3}
    with pytest.raises(UnsupportedLayout, match="lr differ"):
        optimizer_state([dense, expert], 2, 1, "fully_reshardable", "x")
    same = optimizer_state([dense, {**expert, "lr": 1e-3}], 2, 1, "fully_reshardable", "x")
    assert same["optimizer"]["param_groups"] == [dense]
    with pytest.raises(UnsupportedLayout, match="no expert group"):
        optimizer_state([dense], 2, 4, "fully_reshardable", "x")


def test_cli_ep_refused_where_it_does_not_apply(tmp_path):
    """--ep with --to dcp: exit 2, one line, no traceback; an --ep the experts do not divide: exit 1."""
    cmd = [sys.executable, "-m", "zckpt", "convert", str(MEG / "moe16_ep2_dp4")]
    r = subprocess.run(cmd + ["--to", "dcp", "--ep", "2", "-o", str(tmp_path / "a")], capture_output=True, text=True)
    assert r.returncode == 2 and "--ep" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(cmd + ["--to", "megatron", "--ep", "3", "-o", str(tmp_path / "b")], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "do not divide into --ep 3" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_round_trip_through_ep_1_gives_megatrons_own_optimizer_state_back(tmp_path):
    """A real fully_reshardable MoE save (ep 2, its common.pt from Megatron-LM) -> ep 1 -> ep 2: the dense
    optimizer's state in common.pt is again exactly what Megatron-LM saved; the experts' groups hold Megatron's
    expert group and, since an ep 1 checkpoint does not say which dense groups held experts, an expert copy of
    every dense group (megatron-core's loader takes the groups of its own experts' multipliers, ignoring the
    others: moe16_ep1_dp2 -> ep 2 is loaded so above); the content metadata the same, every tensor equal."""
    import zckpt
    src = MEG / "moe16_etp2_ep2_fullyresh"
    _convert(src, tmp_path / "ep1", ep=1)
    back = _convert(tmp_path / "ep1", tmp_path / "back", ep=2)
    said = "the experts' param groups: an expert copy of each of the 2 dense"
    assert any(n.startswith(said) for n in back.plan.notes)
    want, got = _common(src), _common(tmp_path / "back")
    assert sorted(got["optimizer"]) == [0, 1] and got["optimizer"][0] == want["optimizer"][0]
    dense = want["optimizer"][0]["optimizer"]["param_groups"]
    experts = got["optimizer"][1]["optimizer"]["param_groups"]
    assert experts == [{**g, "is_expert_parallel": True} for g in dense]
    assert all(g in experts for g in want["optimizer"][1]["optimizer"]["param_groups"])
    assert got["content_metadata"] == want["content_metadata"]
    assert (got["iteration"], got["opt_param_scheduler"]) == (want["iteration"], want["opt_param_scheduler"])
    r = zckpt.diff(str(src), str(tmp_path / "back"))
    assert r.tensors and all(t.status == "equal" for t in r.tensors) and not (r.only_in_a or r.only_in_b), r.counts


def test_verify_deep_and_info_of_the_output(tmp_path):
    """zckpt's own checks of an output: every item's CRC, every expert once with its master and moments, the ep the
    args now state (info --json's moe)."""
    from click.testing import CliRunner
    from zckpt.cli import main
    _convert(MEG / "moe16_etp2_ep2_fullyresh", tmp_path / "o", ep=1)
    r = CliRunner().invoke(main, ["verify", "--deep", str(tmp_path / "o")])
    assert r.exit_code == 0 and "complete and consistent" in r.output, r.output
    r = CliRunner().invoke(main, ["info", "--json", str(tmp_path / "o")])
    moe = json.loads(r.output)["moe"]
    assert r.exit_code == 0 and (moe["layers"], moe["experts"], moe["ep"]) == (2, 8, 1), moe

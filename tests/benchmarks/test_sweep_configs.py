"""benchmarks/_common.py's sweep_launch_configs: a kernel's launch-table entry swept through a timed call (the
varlen and flex speed scripts' ``--sweep``), on a call whose "time" the test derives from the entry it reads."""
from __future__ import annotations

import pytest

from helpers import benchmark_module
from instability_watch.kernels import configs

TC = configs.TENSOR_CORES


@pytest.fixture(scope="module")
def common():
    return benchmark_module("_common")


def test_every_config_is_timed_in_the_table_the_fastest_are_returned_and_the_table_is_restored(common):
    before = {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()}
    seen = []

    def timed():  # "milliseconds": what the dQ kernel's entry at tile 128 says, as a launch would read it
        cfg = configs.LAUNCH_TABLE[("dq", TC)][128]
        seen.append(cfg)
        if cfg.block_n == 32:
            raise RuntimeError("out of resources: shared memory")
        return cfg.block_m * 10 + cfg.num_warps + cfg.num_stages / 10

    logged = []
    out = common.sweep_launch_configs("dq", 100, timed, log=logged.append)  # head dim 100: tile 128
    grid = [configs.LaunchConfig.of(c) for c in common.BWD_GRID if common.keep(c, 128)]
    table = before[("dq", TC)][128]
    assert seen == [table] + grid  # the table as it stands first, then the grid in order
    assert out["table"] == [[table.block_m, table.block_n, table.num_warps, table.num_stages, None],
                            table.block_m * 10 + table.num_warps + table.num_stages / 10]
    assert out["best"][0] == [[32, 64, 4, 2, None], 324.2]
    assert [ms for _, ms in out["best"]] == sorted(ms for _, ms in out["best"]) and len(out["best"]) == 5
    assert all(c[1] != 32 for c, _ in out["best"])  # the configurations that failed are left out, and said
    assert any("(128, 32, 4, 2, None): RuntimeError: out of resources" in line for line in logged)
    assert {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()} == before


def test_a_forward_sweep_times_the_table_as_it_stands_then_sets_both_forward_entries(common):
    """At tile 128 the plain and the watched forward have different entries: the first timing runs each as it is
    (a switched head's call runs the watched one), and "table" names both."""
    before = {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()}
    plain, watched = before[("fwd", TC)][128], before[("fwd_watched", TC)][128]
    assert plain != watched
    pairs = []

    def timed():
        pairs.append((configs.LAUNCH_TABLE[("fwd", TC)][128], configs.LAUNCH_TABLE[("fwd_watched", TC)][128]))
        return float(len(pairs))

    grid = [(64, 64, 4, 2), (128, 32, 8, 3)]
    out = common.sweep_launch_configs("fwd", 128, timed, grid=grid)
    assert pairs == [(plain, watched)] + [(configs.LaunchConfig.of(c),) * 2 for c in grid]
    as_list = (lambda c: [c.block_m, c.block_n, c.num_warps, c.num_stages, c.maxnreg])
    assert out["table"] == [{"fwd": as_list(plain), "fwd_watched": as_list(watched)}, 1.0]
    assert out["best"] == [[[64, 64, 4, 2, None], 2.0], [[128, 32, 8, 3, None], 3.0]]
    assert {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()} == before


def test_a_forward_sweep_sets_the_watched_forward_too_and_a_failing_call_restores_the_table(common):
    before = {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()}
    pairs = []

    def timed():
        pairs.append((configs.LAUNCH_TABLE[("fwd", TC)][64], configs.LAUNCH_TABLE[("fwd_watched", TC)][64]))
        if len(pairs) == 3:
            raise KeyboardInterrupt  # not a configuration's failure: the sweep stops, the table is restored
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        common.sweep_launch_configs("fwd", 64, timed, grid=[(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2)])
    assert all(a == b for a, b in pairs[1:]) and pairs[1][0] == configs.LaunchConfig(64, 64, 4, 2)
    assert {key: dict(entry) for key, entry in configs.LAUNCH_TABLE.items()} == before


def test_a_kernel_without_an_entry_and_the_tile_the_entries_do_not_reach_are_named(common):
    with pytest.raises(ValueError, match="kernel 'dk' has no launch-table entry at head-dim tile 128"):
        common.sweep_launch_configs("dk", 128, lambda: 1.0)
    with pytest.raises(ValueError, match="head-dim tile 256: the calls there run the Gluon kernels"):
        common.sweep_launch_configs("dkdv", 200, lambda: 1.0)


def test_kernel_resources_name_each_compiled_variant_by_its_constexprs(common, capsys):
    """What a GPU run prints for every compiled variant (registers and spills first), read from Triton's caches;
    here from a stand-in with their shape (Triton's interpreter compiles nothing: nothing to report)."""
    from types import SimpleNamespace as NS

    class Compiled:
        n_regs, n_spills, metadata = 168, 24, NS(shared=98304, num_warps=8, num_stages=3)

        def _init_handles(self):
            pass

    params = [NS(name="Q", is_constexpr=False), NS(name="Order", is_constexpr=False), NS(name="H", is_constexpr=False),
              NS(name="CAUSAL", is_constexpr=True), NS(name="MASK_KIND", is_constexpr=True),
              NS(name="BLOCK_M", is_constexpr=True)]
    # as Triton writes it: a None pointer and an int equal to 1 read as constexprs too
    key = ("[('*bf16', 'D'), ('constexpr', None), ('constexpr', 1), ('constexpr', False), ('constexpr', 3), "
           "('constexpr', 128)]{'num_warps': 8, 'debug': ('a', 'b')}")
    jit = NS(params=params, device_caches={0: ({key: Compiled()}, {}, None, None, None)}, __name__="attn_fwd")
    rows = common.kernel_resources(NS(fn=jit), object())  # through a wrapper's .fn; a non-kernel is skipped
    assert rows == [{"kernel": "attn_fwd", "constexprs": {"CAUSAL": "False", "MASK_KIND": "3", "BLOCK_M": "128"},
                     "regs": 168, "spills": 24, "shared": 98304, "num_warps": 8, "num_stages": 3}]
    common.print_kernel_resources(rows)
    assert capsys.readouterr().out.strip() == ("resources attn_fwd: CAUSAL=False MASK_KIND=3 BLOCK_M=128 warps=8 "
                                               "stages=3 regs=168 spills=24 shared=98304")

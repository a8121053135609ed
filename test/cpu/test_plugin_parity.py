"""The parity benchmark's verdicts (benchmark/serving/plugin_parity.py summarize): a wrong verdict would
report a plugin leak or a missed load as fine, or flag a correct run."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmark/serving"))
_spec = importlib.util.spec_from_file_location("plugin_parity", REPO / "benchmark/serving/plugin_parity.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

LOADED = ["[sglang-h20 pid 7] hooks applied: 3/3 (a, b, c)"]


def phase(name, ids, lines, tput=100.0):
    return {"phase": name, "output_ids": ids, "plugin_log_lines": lines,
            "hooks_applied_lines": [ln for ln in lines if "hooks applied" in ln],
            "bench": [{"output_throughput": tput}]}


def test_loaded_in_every_phase_but_upstream():
    ok = bench.summarize([phase("upstream", [[1, 2]], []), phase("plugin-off", [[1, 2]], LOADED),
                          phase("features", [[1, 2]], LOADED)])
    assert ok["plugin_loaded_only_when_expected"] and ok["greedy_ids_identical"] and ok["plugin_hooks_all_applied"]
    leak = bench.summarize([phase("upstream", [[1, 2]], LOADED), phase("features", [[1, 2]], LOADED)])
    assert not leak["plugin_loaded_only_when_expected"]
    missing = bench.summarize([phase("upstream", [[1, 2]], []), phase("features", [[1, 3]], [])])
    assert not missing["plugin_loaded_only_when_expected"] and not missing["greedy_ids_identical"]


def test_partly_applied_hooks_are_flagged():
    s = bench.summarize([phase("upstream", [[1]], []),
                         phase("plugin-off", [[1]], ["[sglang-h20 pid 7] hooks applied: 2/3 (a, b)"])])
    assert not s["plugin_hooks_all_applied"]


def test_observed_passes_counts_twin_replays_and_eager_samples(tmp_path):
    """The 'features' phase reports how its sampled passes ran, so a parity run with observation on shows the
    instrumented twins were replayed (not silently skipped) while the greedy ids stayed equal."""
    import json

    assert bench.observed_passes(tmp_path / "missing") == {}
    dump = tmp_path / "observe"
    dump.mkdir()
    recs = [{"kind": "stages", "step": 1, "rank": 0, "graph_sampled": True},
            {"kind": "stages", "step": 2, "rank": 0, "graph_sampled": True},
            {"kind": "stages", "step": 3, "rank": 0, "graph_sampled": False},
            {"kind": "graph", "step": 4, "rank": 0}]
    (dump / "observe-rank000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert bench.observed_passes(dump) == {"graph": 2, "eager": 1}

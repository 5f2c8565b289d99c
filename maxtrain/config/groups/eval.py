"""The evaluation keys (group `eval`): what is evaluated and how often; not part of what a run trains."""

from __future__ import annotations

from maxtrain.runtime.declaration import Key, declare


def _no_eval_data(c) -> str | None:
    """data.make_iterators makes eval batches only from eval_files, eval_sources or a split."""
    if c["eval_interval"] <= 0:
        return None
    if c["dataset_type"] == "synthetic" and not c["data_sources"]:
        return f"eval_interval: {c['eval_interval']} has no effect: dataset_type=synthetic has no eval data"
    if not c["eval_files"] and not c["eval_sources"] and c["eval_split_fraction"] == 0:
        return (f"eval_interval: {c['eval_interval']} has no effect: no eval data (set eval_files or "
                "eval_split_fraction)")
    return None


declare(
    Key("eval_files", "eval", path="inputs"),
    Key("eval_sources", "eval"),
    Key("eval_interval", "eval", at_least=0, no_effect=_no_eval_data),
    Key("eval_steps", "eval", at_least=1),
)

"""The README card of a trained AIRSolver: architecture variant, data, recipe, measured results."""

from __future__ import annotations

from typing import Any

__all__ = ["render_air_card"]

_METRICS = (("exact_accuracy", "exact accuracy"), ("token_accuracy", "token accuracy"),
            ("valid_optimal_accuracy", "valid and optimal path accuracy"))


def _dataset(train_config: dict[str, Any], size: int) -> tuple[str, str]:
    if train_config.get("task") == "maze":
        return ("hf-memory/maze-offline", f"{size}x{size} mazes generated offline (Lehnert-style, "
                "long shortest paths; a stand-in for sapientinc/maze-30x30-hard-1k)")
    return ("hf-memory/sudoku-offline", f"{size}x{size} Sudoku generated offline (minimal unique "
            "puzzles; a stand-in for sapientinc/sudoku-extreme)")


def render_air_card(log: dict[str, Any], model_name: str = "air-solver") -> str:
    """Markdown with YAML front matter (``model-index`` results) for an ``air-train`` log."""
    model = log["model_config"]
    train = log["train_config"]
    size = int(round(model["seq_len"] ** 0.5))
    dataset_id, dataset_name = _dataset(train, size)
    final = log.get("final") or {}
    results = final.get("eval") or {}
    task = train.get("task", "sudoku")
    lines = ["---", "library_name: transformers", "tags:", "- air", "- recurrent-reasoning",
             f"- {task}", "model-index:", f"- name: {model_name}", "  results:",
             "  - task:", "      type: puzzle-solving", f"      name: {task} solving",
             "    dataset:", f"      type: {dataset_id}", f"      name: {dataset_name}",
             "      split: test", "    metrics:"]
    for key, name in _METRICS:
        if key in results:
            lines += [f"    - type: {key}", f"      name: {name}",
                      f"      value: {float(results[key]):.4f}"]
    lines += ["---", "", f"# {model_name}", "",
              "An `AIRSolver` (Asymmetric Input Recurrence, *One Model, Two Roles*): one shared "
              "transformer block updating two latent states, z_L (receives the encoded input) and "
              "z_H (decoded by the output head), with ACT halting.", "",
              "| field | value |", "| --- | --- |"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "H_cycles", "L_cycles",
                "injection", "level_token", "input_operator", "single_state", "share_weights",
                "halt_max_steps", "loss_type"):
        lines.append(f"| `{key}` | {model.get(key)} |")
    lines += ["", f"Trained for {final.get('step', '?')} steps on {log.get('train_size', '?')} "
              f"puzzles ({dataset_name}); batch {train.get('batch_size')}, AdamATan2 lr "
              f"{train.get('lr')}, weight decay {train.get('weight_decay')}, EMA "
              f"{train.get('ema_decay')}. Held-out puzzles ({log.get('eval_size', '?')}) are "
              "disjoint from training up to isomorphism and solved to the segment limit.", ""]
    if results:
        lines += ["| held-out metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {float(results[key]):.4f} |" for key, name in _METRICS
                  if key in results]
        lines.append("")
    lines += ["```python", "from transformers import AutoModel", "",
              'model = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)',
              "solution = model.solve(input_ids)   # [batch, cells] token ids", "```", ""]
    return "\n".join(lines)

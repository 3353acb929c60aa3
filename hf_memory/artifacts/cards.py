"""The README cards of saved artifacts: what a bank set steers, with what text, for which model;
where a selector steers and how it was calibrated."""

from __future__ import annotations

from typing import Any

__all__ = ["render_bank_card", "render_selector_card"]


def _source_lines(provenance: dict[str, Any]) -> list[str]:
    if provenance.get("source") == "text":
        templates = ", ".join(f"`{v['template']}`" for v in provenance.get("variants", []))
        return [f"  - source text (sha256 `{provenance['text_sha256'][:16]}…`):",
                f"    > {provenance['text']}",
                f"  - templates: {templates}; kept positions: {provenance.get('keep')}"]
    if "concatenated" in provenance:
        lines = ["  - concatenated from:"]
        for part in provenance["concatenated"]:
            lines += ["  " + line for line in _source_lines(part)]
        return lines
    return [f"  - source: {provenance.get('source', 'unspecified')}"]


def render_bank_card(config: dict[str, Any]) -> str:
    """Markdown with YAML front matter for a bank set's ``config.json`` dictionary."""
    fingerprint = config.get("fingerprint") or {}
    base = fingerprint.get("name_or_path") or "unspecified"
    lines = [
        "---",
        "library_name: hf-memory",
        "tags:",
        "- memory-inception",
        "- steering",
        "- kv-bank",
    ]
    if base != "unspecified":
        lines.append(f"base_model: {base}")
    lines += [
        "---",
        "",
        "# Memory-inception bank set",
        "",
        "Latent key/value banks that steer a stock model at selected attention layers during "
        "`generate()` (memory inception). **This artifact changes model behaviour; the steering "
        "content is disclosed below.**",
        "",
        f"- base model: `{base}` ({fingerprint.get('model_type')}, "
        f"{fingerprint.get('num_hidden_layers')} layers, {fingerprint.get('num_key_value_heads')} "
        f"KV heads, weights digest `{fingerprint.get('weights_digest')}`)",
        f"- mixture: gamma = {config['gamma']}, size-normalised evidence = "
        f"{config['size_normalize']}",
        f"- format version {config['format_version']}, written by hf-memory "
        f"{config['library_version']}",
        "",
        "## Banks",
        "",
    ]
    for bank in config["banks"]:
        layers = bank["layers"]
        lines += [
            f"- **{bank['name']}** ({bank['role']}, gain {bank['gain']}): {bank['num_slots']} "
            f"slots × {len(layers)} layers (layers {layers[0]}–{layers[-1]}), "
            f"{bank['dtype']}, content hash `{bank['content_hash'][:16]}…`",
            *_source_lines(bank["provenance"]),
        ]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from hf_memory import BankSet, steer",
        "banks = BankSet.from_pretrained(path, model=model)  # refuses a different model",
        "with steer(model, banks):",
        "    model.generate(**inputs)",
        "```",
        "",
    ]
    return "\n".join(lines)


def render_selector_card(selector: Any) -> str:
    """Markdown with YAML front matter for a :class:`~hf_memory.selection.selector.Selector`."""
    config = selector.config
    model = (selector.fingerprint or {}).get("name_or_path") or "unspecified"
    if config.get("objective") == "behavioural_budgeted":
        best = config["best"]
        how = (f"cost-budgeted behavioural search on `{model}` over "
               f"{len(selector.candidate_layers)} candidate layers with {config['num_pairs']} "
               f"calibration pairs: strength {selector.strength:g} within a budget of "
               f"{config['cost_budget']:g} nats/token of neutral text (cost "
               f"{best['cost']:+.3f}), calibration target shift net of a neutral bank "
               f"{best['target']:+.2f}, drift {best['drift']:.2f}, "
               f"{config['steered_heads']} query heads steered, {config['evaluations']} "
               "configurations scored.")
    elif config.get("objective") == "voice_band":
        band = config["voice_band"]
        slots = ("every slot" if band["slots"] is None
                 else f"{len(band['slots'])} slots of highest attention")
        how = (f"a voice band on `{model}`: the persona text as a `prompt_like` bank ({slots}) "
               f"at layers {band['layers'][0]}-{band['layers'][-1]}, ρ {band['rho']:g}, cost "
               f"{band['cost']:+.3f} nats/token, {band['kv_fraction']:.2f}x the prompt's KV, "
               f"its replies judged {band['judged']:.2f} by a judge fitted on the pairs.")
    elif config.get("objective") == "behavioural":
        best = config["best"]
        how = (f"behavioural search on `{model}` over {len(selector.candidate_layers)} candidate "
               f"layers with {config['num_pairs']} calibration pairs (drift groups "
               f"{config['drift_groups']}): calibration target shift {best['target']:+.2f}, "
               f"drift {best['drift']:.2f}, {config['evaluations']} configurations scored.")
    else:
        how = (f"diagnostic calibration (algorithm 1) on `{model}` with "
               f"{config.get('num_prompts')} prompts (ξ = {config.get('xi')}, "
               f"χ = {config.get('chi')}, order {config.get('order', 'score')}, "
               f"{config.get('aggregate')} over the top {config.get('top_units')} units).")
    lines = ["---", "library_name: hf-memory", "tags:", "- memory-inception", "- selector", "---",
             "", "# Memory-inception selector", "",
             f"Frozen sites: unit type `{selector.unit_type}`; {how}", "",
             "| layer | units | ρ |", "| --- | --- | --- |"]
    lines += [f"| {layer} | {selector.units[layer]} | {selector.layer_gains[layer]:.3f} |"
              for layer in selector.layers]
    return "\n".join(lines) + "\n"

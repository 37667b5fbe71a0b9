"""Plain-text rendering of an estimate: aligned label/value lines and one memory table."""

from __future__ import annotations

from typing import Any

_WIDTH = 30  # label column


def sig3(x: float) -> str:
    """Three significant digits for people: 1,580 (never 1.58e+03), 15.6, 0.125."""
    if abs(x) >= 100:
        return f"{float(f'{x:.3g}'):,.0f}"
    return f"{x:.3g}"


def count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{sig3(n / scale)}{unit}"
    return f"{n:,.0f}"


def size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def duration(seconds: float) -> str:
    for unit, scale in (("days", 86_400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= scale:
            return f"{seconds / scale:,.1f} {unit}"
    return f"{seconds * 1e3:,.1f} ms"


def number(x: float) -> str:
    """Thousands separators for big figures, three significant digits for small ones."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _line(label: str, value: str) -> str:
    return f"  {label:<{_WIDTH}} {value}"


def render(result: dict[str, Any]) -> str:
    return "\n".join(_header(result) + _compute(result["compute"], result.get("compute_needs", []))
                     + _memory(result["memory"]) + _checkpoint(result)) + "\n"


def _header(r: dict[str, Any]) -> list[str]:
    par, m = r["parallel"], r["model"]
    params, active = m["params"], m["active_params"]
    lines = [f"model: {count(params)} parameters ({params:,.0f}) from {m['source']}"]
    if active != params:
        lines.append(f"       {count(active)} active per token ({active:,.0f}): a mixture of experts")
    if m.get("shape") is not None:
        seq = m.get("seq_len")
        lines.append(f"seq:   {seq:,} tokens per sample, from {m.get('seq_len_source') or 'the shape'}" if seq
                     else "seq:   not given: the parameter count needs none; FLOPs, time, activations need --seq-len")
    return lines + [f"job:   {par['gpus']} GPU{'s' if par['gpus'] > 1 else ''} = "
                    f"dp {par['dp']} x tp {par['tp']} x pp {par['pp']}"
                    + (f" (ep {par['ep']} within dp)" if par["ep"] > 1 else "")
                    + (" (sequence parallel)" if par["sequence_parallel"] else "")]


def _compute(c: dict[str, Any] | None, needs: list[str]) -> list[str]:
    if c is None:
        return ["", "compute", _line("training FLOPs", f"give {' and '.join(needs or ['--tokens'])}")]
    lines = ["", "compute", _line("tokens", count(c["tokens"])),
             _line("training FLOPs (6ND)", f"{c['flops']:.3g}"), _line("PF-days", number(c["pf_days"]))]
    if c["flops_counted"] is not None:
        lines.append(_line("FLOPs counted (meta forward)", f"{c['flops_counted']:.3g} (the model FLOPs)"))
    elif c["flops_with_attention"] is not None:
        lines.append(_line("model FLOPs (+ attention)", f"{c['flops_with_attention']:.3g}"))
    if c["hardware_flops"] != c["model_flops"]:
        lines.append(_line("hardware FLOPs (+ recompute)", f"{c['hardware_flops']:.3g}"))
    peak = f"{c['gpu']} {c['precision']} {c['peak_tflops_per_gpu']:,.1f} TFLOP/s dense"
    given = "mfu" if c["utilisation_from"] == "--mfu" else "hfu"
    return lines + [_line("peak per GPU", peak),
                    _line("MFU / HFU", f"{c['mfu']:.1%} / {c['hfu']:.1%} ({given} given; "
                                       f"{c['model_tflops_per_gpu']:,.0f} / {c['hardware_tflops_per_gpu']:,.0f} "
                                       "TFLOP/s per GPU)"),
                    _line("tokens/s", f"{number(c['tokens_per_second'])} "
                                      f"({number(c['tokens_per_second_per_gpu'])} per GPU)"),
                    _line(f"wall time at {c[given]:.0%} {given.upper()}", f"{duration(c['wall_seconds'])} "
                          f"({number(c['gpu_hours'])} GPU-hours)")]


def _memory(m: dict[str, Any]) -> list[str]:
    rows = m["strategies"]
    peak = max(row["total"] for row in rows.values())
    unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6)) if peak >= s), ("KB", 1e3))
    cols = ("weights", "grads", "optimizer", "gathered", "activations", "total")
    lines = ["", f"memory per GPU ({unit}): {m['layout']}, micro-batch {m['micro_batch']}, "
                 f"activation checkpointing {m['activation_checkpointing']}",
             f"  {'strategy':<9}" + "".join(f"{c:>13}" for c in cols) + f"{'fits ' + size(m['gpu_memory_bytes']):>16}"]
    for name, row in rows.items():
        cells = "".join(f"{'n/a' if row[c] is None else f'{row[c] / scale:,.1f}':>13}" for c in cols)
        mark = "*" if name == m["selected"] else " "
        lines.append(f"{mark} {name:<9}{cells}{'yes' if row['fits'] else 'no':>16}")
    fit = m["smallest_fit"] or "none: add GPUs, raise --tp/--pp, or checkpoint activations"
    lines += [_line("activations", m["activations_method"])]
    if m["pipeline"]:
        lines.append(_line("pipeline stages (layers)", _stages(m["pipeline"])))
    lines.append(_line("smallest strategy that fits", fit))
    if m["selected"] in rows and not m.get("declared"):  # with a shape the declared line below says it
        row = rows[m["selected"]]
        verdict = "fits" if row["fits"] else "does NOT fit"
        lines.append(_line(f"--strategy {m['selected']}", f"{size(row['total'])} per GPU: {verdict}"))
    return lines + _declared(m.get("declared"))


def _declared(d: dict[str, Any] | None) -> list[str]:
    """The selected strategy's declared memory (hpctrain.estimate.strategy_memory), part by part."""
    if d is None:
        return []
    name = d["strategy"] + (f" stage {d['deepspeed_stage']}" if d["deepspeed_stage"] else "")
    parts = [("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
             ("gathered", "gathered"), ("pipeline-held", "pipeline_held"), ("activations", "activations"),
             ("recomputed block", "recomputed"), ("buffers", "transient")]
    shown = ", ".join(f"{label} {size(d[key])}" for label, key in parts if d[key])
    offload = f"; {size(d['offloaded'])} in host memory" if d["offloaded"] else ""
    verdict = "fits" if d["fits"] else "does NOT fit"
    return [_line(f"declared ({name}, {d['attention']} attention)",
                  f"{size(d['total'])} per GPU ({verdict}): {shown}{offload}")]


def _stages(pipe: dict[str, Any]) -> str:
    """'7, 8 x14, 7: per GPU, the largest (stage 1, 8 layers)': runs of equal stages folded."""
    runs: list[list[int]] = []
    for n in pipe["stage_layers"]:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    text = ", ".join(f"{n}" if k == 1 else f"{n} x{k}" for n, k in runs)
    return (f"{text}; memory per GPU is the largest stage's (stage {pipe['largest_stage']}, "
            f"{pipe['largest_stage_layers']} layers)")


def _checkpoint(r: dict[str, Any]) -> list[str]:
    ck, rel = r["checkpoint"], r["reliability"]
    return ["", "checkpointing",
            _line("checkpoint size", f"{size(ck['bytes'])} ({ck['bytes_per_param']:g} B/param, no gradients)"),
            _line(f"write time at {ck['bandwidth_bytes_per_s'] / 1e9:g} GB/s", duration(ck["write_seconds"])),
            _line("MTBF per GPU", f"{rel['gpu_mtbf_hours']:,.0f} h, {rel['mtbf_source']}"),
            _line(f"cluster MTBF ({rel['gpus']} GPU{'s' if rel['gpus'] > 1 else ''})",
                  duration(rel["cluster_mtbf_hours"] * 3600)),
            _line("Young-Daly interval", f"{duration(rel['young_daly_seconds'])} = sqrt(2 x save x MTBF)"),
            _line("expected overhead", f"{rel['overhead_fraction']:.1%} of wall time (saving + lost work)")]

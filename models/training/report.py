"""What a training run leaves behind: the decay spectrum, plots, ``TRAINING.md``, ``SHA256SUMS``.

The decay spectrum is measured, not read off the parameters: a GDN head's decay
``alpha = exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)`` depends on the token, so
the held-out windows are run through the model and ``alpha`` is recorded at every token. Per
GDN head: the mean over tokens and the 10/50/90th percentiles; per KDA head (``dk`` channels,
one ``alpha`` each): every channel's mean over tokens, summarised by head. A head (GDN) or
channel (KDA) counts as long-memory when its mean ``alpha`` exceeds 0.99 (a memory of
``1 / (1 - alpha) > 100`` tokens).

``TRAINING.md`` is rendered from the run's JSON (``training.json``) by ``render_training_md``;
no number in it is written by hand.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.training.model import TrainingRecurrence, forward_logits

LONG_MEMORY = 0.99
# the second, stricter threshold of the summaries (a memory of more than 1,000 tokens)
VERY_LONG_MEMORY = 0.999
SUMS_FILE = "SHA256SUMS"


# ----------------------------------------------------------------------------- decay spectrum


def decay_spectrum(arch, config, params, windows: np.ndarray, *, batch: int, recurrence: TrainingRecurrence) -> dict:
    """Per-layer, per-head statistics of the decays ``alpha`` over the tokens of ``windows``
    (``[N, T + 1]`` int32; the first ``T`` tokens of each are run). See the module docstring."""

    def per_batch(params, ids):
        _, traces = forward_logits(arch, config, params, ids, recurrence, record=True)
        # GDN: alpha at every token [B, T, H]; KDA: per-channel sums over tokens [H, dk]
        return {layer: (jnp.exp(tr["g"]) if tr["g"].ndim == 3 else jnp.sum(jnp.exp(tr["g"]), axis=(0, 1)))
                for layer, tr in traces.items()}

    run = jax.jit(per_batch)
    ids = windows[:, :-1]
    n = (len(ids) // batch) * batch or len(ids)
    collected: dict = {}
    for i in range(0, n, min(batch, n)):
        for layer, x in jax.device_get(run(params, ids[i:i + batch])).items():
            collected.setdefault(layer, []).append(np.asarray(x, np.float64))
    tokens = int(n * ids.shape[1])
    layers = []
    for layer in sorted(collected):
        parts = collected[layer]
        if parts[0].ndim == 3:  # GDN
            alpha = np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts])  # [tokens, H]
            heads = [{"head": h, "mean_alpha": float(alpha[:, h].mean()),
                      "p10": float(np.quantile(alpha[:, h], 0.1)), "p50": float(np.quantile(alpha[:, h], 0.5)),
                      "p90": float(np.quantile(alpha[:, h], 0.9))} for h in range(alpha.shape[1])]
        else:  # KDA
            channel_mean = np.sum(parts, axis=0) / tokens  # [H, dk]
            heads = [{"head": h, "mean_alpha": float(c.mean()), "channel_min": float(c.min()),
                      "channel_p50": float(np.median(c)), "channel_max": float(c.max()),
                      "channels_above": int(np.sum(c > LONG_MEMORY)),
                      "channels_above_0.999": int(np.sum(c > VERY_LONG_MEMORY)), "channels": int(c.size),
                      "channel_mean_alpha": [float(x) for x in c]}
                     for h, c in enumerate(channel_mean)]
        layers.append({"layer": int(layer), "heads": heads})
    kind = "kda" if layers and "channels" in layers[0]["heads"][0] else "gdn"
    all_heads = [h for lay in layers for h in lay["heads"]]
    summary = {"heads": len(all_heads), "heads_mean_above": sum(h["mean_alpha"] > LONG_MEMORY for h in all_heads),
               "heads_mean_above_0.999": sum(h["mean_alpha"] > VERY_LONG_MEMORY for h in all_heads)}
    if kind == "kda":
        summary.update(channels=sum(h["channels"] for h in all_heads),
                       channels_above=sum(h["channels_above"] for h in all_heads),
                       **{"channels_above_0.999": sum(h["channels_above_0.999"] for h in all_heads)},
                       heads_with_channel_above=sum(h["channels_above"] > 0 for h in all_heads))
    return {"kind": kind, "threshold": LONG_MEMORY, "tokens": tokens, "windows": int(n), "layers": layers,
            "summary": summary}


def spectrum_values(spectrum: dict) -> dict[int, np.ndarray]:
    """Per layer, the mean ``alpha`` of every GDN head or of every KDA channel."""
    if spectrum["kind"] == "kda":
        return {lay["layer"]: np.concatenate([h["channel_mean_alpha"] for h in lay["heads"]])
                for lay in spectrum["layers"]}
    return {lay["layer"]: np.array([h["mean_alpha"] for h in lay["heads"]]) for lay in spectrum["layers"]}


# ----------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(history: dict, path, *, title: str) -> Path:
    """Training loss per step (raw and smoothed) and held-out loss at each evaluation -> PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = history["train"]
    if train:
        steps = np.array([e["step"] for e in train])
        loss = np.array([e["loss"] for e in train])
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        k = max(1, len(loss) // 50)
        if k > 1:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1:], smooth, color="tab:blue", lw=1.5, label=f"train ({k}-step mean)")
    ev = history["eval"]
    if ev:
        ax.plot([e["step"] for e in ev], [e["heldout_loss"] for e in ev], "o-", color="tab:red", ms=3,
                label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_accuracy_curve(history: dict, path, *, title: str) -> Path:
    """Held-out recall accuracy at each evaluation (a task run's ``history["eval"]``) -> PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ev = [e for e in history["eval"] if e.get("recall_accuracy") is not None]
    ax.plot([e["step"] for e in ev], [e["recall_accuracy"] for e in ev], "o-", color="tab:green", ms=3)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy on the queried values")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_spectrum(spectrum: dict, path, *, title: str) -> Path:
    """``1 - mean alpha`` (log scale) of every GDN head or KDA channel, one column per layer,
    the long-memory threshold as a line -> PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    rng = np.random.default_rng(0)  # horizontal jitter only, so overlapping points stay visible
    unit = "channel" if spectrum["kind"] == "kda" else "head"
    for layer, v in spectrum_values(spectrum).items():
        gap = np.maximum(1.0 - v, 1e-7)
        ax.scatter(layer + rng.uniform(-0.25, 0.25, gap.size), gap, s=8 if unit == "channel" else 24, alpha=0.6)
    ax.axhline(1 - LONG_MEMORY, color="k", ls="--", lw=1, label=f"mean alpha = {LONG_MEMORY}")
    ax.set_yscale("log")
    ax.invert_yaxis()  # long memory at the top
    ax.set_xticks([lay["layer"] for lay in spectrum["layers"]])
    ax.set_xlabel("layer")
    ax.set_ylabel(f"1 - mean alpha per {unit}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- TRAINING.md


def _fmt(x, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _spectrum_md(spectrum: dict) -> list[str]:
    s = spectrum["summary"]
    thr = spectrum["threshold"]
    out = [f"Measured on {spectrum['tokens']:,} held-out tokens ({spectrum['windows']} windows). "
           f"`alpha = exp(g)` per token; memory = `1 / (1 - mean alpha)` tokens."]
    if spectrum["kind"] == "gdn":
        out.append(f"Heads with mean alpha > {thr}: **{s['heads_mean_above']} of {s['heads']}** "
                   f"(> 0.999: {s['heads_mean_above_0.999']}).")
        if s["heads_mean_above"] <= s["heads"] // 10:
            out.append(f"Few long-memory heads grew in this run ({s['heads_mean_above']} of {s['heads']}).")
        out += ["", "| layer | head | mean alpha | p10 | p50 | p90 | memory (tokens) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for lay in spectrum["layers"]:
            for h in lay["heads"]:
                mem = 1.0 / max(1.0 - h["mean_alpha"], 1e-12)
                out.append(f"| {lay['layer']} | {h['head']} | {h['mean_alpha']:.5f} | {h['p10']:.5f} | {h['p50']:.5f} | "
                           f"{h['p90']:.5f} | {mem:,.1f} |")
    else:
        out.append(f"Channels with mean alpha > {thr}: **{s['channels_above']} of {s['channels']}**, in "
                   f"**{s['heads_with_channel_above']} of {s['heads']} heads**; heads whose mean over channels "
                   f"exceeds {thr}: {s['heads_mean_above']}."
                   + (f" Channels with mean alpha > {VERY_LONG_MEMORY}: {s['channels_above_0.999']}; heads whose mean "
                      f"exceeds it: {s['heads_mean_above_0.999']}." if "channels_above_0.999" in s else ""))
        if s["heads_with_channel_above"] <= s["heads"] // 10:
            out.append(f"Few long-memory heads grew in this run ({s['heads_with_channel_above']} of {s['heads']} "
                       f"have a channel above {thr}).")
        out += ["", f"| layer | head | mean alpha | channel min | channel median | channel max | channels > {thr} |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for lay in spectrum["layers"]:
            for h in lay["heads"]:
                out.append(f"| {lay['layer']} | {h['head']} | {h['mean_alpha']:.5f} | {h['channel_min']:.5f} | "
                           f"{h['channel_p50']:.5f} | {h['channel_max']:.5f} | {h['channels_above']} of {h['channels']} |")
    return out


def _command_md(run: dict) -> list[str]:
    """TRAINING.md's ``## Command`` section."""
    return ["## Command", "", "```bash", run["command"], "```", ""]


def _model_md(m: dict, *, attention: bool) -> list[str]:
    """TRAINING.md's ``## Model`` table of ``run["model"]``; ``attention``: with the attention row."""
    return [
        "## Model",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | `{m['model_type']}`: {m['layout']} |",
        f"| parameters | {m['parameters']:,} ({m['bytes']:,} bytes as stored) |",
        f"| linear attention | {m['linear']} |",
        *([f"| attention | {m['attention']} |"] if attention else []),
        f"| MLP | {m['mlp']} |",
        f"| vocabulary | {m['vocab_size']:,} |",
        "",
    ]


def _training_rows(run: dict) -> list[str]:
    """TRAINING.md's ``## Training`` heading and the rows every run has, steps to recurrence (the
    caller adds its own rows and the seed)."""
    t, p = run["train"], run["progress"]
    return [
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| steps | {p['steps']:,} of a {p['total_steps']:,}-step schedule (stopped by {p['stopped_by']}) |",
        f"| tokens seen | {p['tokens_seen']:,} ({t['batch']} rows x {t['seq_len']:,} tokens per step) |",
        f"| time | {p['train_seconds']:.0f} s in the training loop ({p['tokens_per_second']:,.0f} tokens/s, "
        f"compilation and evaluation included); {p['wall_seconds']:.0f} s for the whole command |",
        f"| device | {run['environment']['device']} (JAX {run['environment']['jax']}, Python {run['environment']['python']}) |",
        f"| optimizer | AdamW (b1 {t['b1']}, b2 {t['b2']}, eps {t['eps']}, weight decay {t['weight_decay']} on matrices), "
        f"clip global norm {t['clip_norm']}; fp32 parameters and moments |",
        f"| schedule | linear warm-up over {t['warmup_steps']} steps to {t['peak_lr']}, cosine decay to "
        f"{t['final_lr_fraction']} of the peak |",
        f"| recurrence | {t['recurrence']} (chunk {t['chunk']}), fp32 |",
    ]


def render_training_md(run: dict) -> str:
    """``TRAINING.md`` from a run dict (the ``training.json`` the train command writes)."""
    d, m, t, f = run["data"], run["model"], run["train"], run["final"]
    recall = t["recall"]
    lines = [
        f"# {run['name']}",
        "",
        f"A {m['description']}, trained from scratch by `leapquant train` on CPython {d['python_version']}'s "
        f"standard-library sources. Files: `config.json`, `model.safetensors` ({m['dtype_note']}), "
        f"`tokenizer.json`, `tokenizer_config.json`; `training.json` holds every number below and the full "
        f"loss history; `SHA256SUMS` fingerprints every file.",
        "",
        *_command_md(run),
        "## Data",
        "",
        "| | |",
        "| --- | --- |",
        f"| source | CPython {d['python_version']} standard library (`{d['source']}`) |",
        f"| selection | {d['selection']} |",
        f"| files | {d['files']:,} ({d['splits']['train']['files']:,} train, {d['splits']['heldout']['files']:,} held out); "
        f"{len(d['excluded'])} excluded |",
        f"| held-out rule | {d['held_out_rule']} |",
        f"| file list sha256 | `{d['file_list_sha256']}` |",
        f"| contents sha256 | `{d['contents_sha256']}` (of `DATA_FILES.txt`: split, sha256 and path of every file) |",
        f"| tokenizer | byte-level BPE, {d['vocab_size']:,} tokens, trained on the training split (sha256 `{d['tokenizer_sha256']}`) |",
        f"| tokens | {d['splits']['train']['tokens']:,} train, {d['splits']['heldout']['tokens']:,} held out |",
        "",
    ]
    if d["excluded"]:
        lines += ["Excluded: " + "; ".join(f"`{e['path']}` ({e['reason']})" for e in d["excluded"]) + ".", ""]
    lines += [
        *_model_md(m, attention=True),
        *_training_rows(run),
        "| recall task | "
        + (f"{recall['fraction']:.0%} of rows: {recall['pairs']} key-value pairs, then at least {recall['min_gap']:,} "
           f"tokens of text, then every key queried in random order |" if recall["fraction"] else "none |"),
        f"| seed | {t['seed']} |",
        "",
        "## Results",
        "",
        "| | |",
        "| --- | --- |",
        f"| final train loss | {_fmt(f['train_loss'])} nats/token (mean of the last {f['train_loss_steps']} steps, "
        f"recall rows included) |",
        f"| final held-out loss | {_fmt(f['heldout_loss'])} nats/token over {f['heldout_tokens']:,} tokens "
        f"(about {_fmt(f['heldout_bits_per_byte'], 3)} bits per byte) |",
        f"| recall accuracy | {_fmt(f['recall_accuracy'], 3) if f['recall_accuracy'] is not None else 'not trained'}"
        + (f" ({t['batch']} held-out rows, {recall['pairs']} queries each, gap >= {recall['min_gap']:,} tokens) |"
           if f["recall_accuracy"] is not None else " |"),
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Decay spectrum",
        "",
    ]
    lines += _spectrum_md(run["spectrum"])
    lines += ["", "![decay spectrum](decay_spectrum.png)", ""]
    return "\n".join(lines)


def _eval_table(history: dict, rows: int = 12) -> list[str]:
    ev = history["eval"]
    if len(ev) > rows:  # evenly spaced evaluations, the last one included
        ev = [ev[round(i * (len(ev) - 1) / (rows - 1))] for i in range(rows)]
    out = ["| step | held-out loss | accuracy |", "| --- | --- | --- |"]
    out += [f"| {e['step']:,} | {e['heldout_loss']:.4f} | {e['recall_accuracy']:.4f} |" for e in ev]
    return out


def render_task_training_md(run: dict) -> str:
    """``TRAINING.md`` of a task run (``leapquant train --task``) from its ``training.json`` dict."""
    task, m, t, f = run["task"], run["model"], run["train"], run["final"]
    mix, v = task["mix"], task["mix"]["vocab"]
    fillers = v["size"] - 1 - v["keys"] - v["values"]
    spreads = ", ".join(f"{x:g}" for x in mix["spreads"])
    lines = [
        f"# {run['name']}",
        "",
        f"A {m['description']}, with no softmax-attention layer, trained from scratch by `leapquant train --task "
        f"{task['task']}` on generated multi-query associative recall rows (`models/tasks.py`): every recalled value "
        f"crosses the recurrent state. Files: `config.json`, `model.safetensors` ({m['dtype_note']}), `task.json` "
        f"(the vocabulary split and the training rows, read by `leapquant task`); `training.json` holds every number "
        f"below and the full history; `SHA256SUMS` fingerprints every file.",
        "",
        *_command_md(run),
        "## Task rows",
        "",
        "| | |",
        "| --- | --- |",
        f"| vocabulary | {v['size']:,} ids: id 0 reserved, {v['keys']:,} keys, {v['values']:,} values, {fillers:,} filler |",
        f"| row | {t['seq_len']:,} tokens: N key-value pairs, then the queries (every key once, random order, random "
        f"positions), filler everywhere else; scored: the value after each queried key |",
        "| fillers | " + "; ".join({"pairs": "distractor key-value pairs on the key ids the row never queries "
                                             "(every token a write)",
                                    "noise": "uniform noise tokens from the filler ids"}[x] for x in mix["fillers"])
        + " (equal shares) |",
        f"| pair counts N | {', '.join(str(n) for n in mix['pairs'])} (equal shares of every batch) |",
        f"| query spreads | {spreads} (the query region as a fraction of the row after the pairs; 0 = packed right "
        f"after them) |",
        f"| needle rows | {mix['needle_rows']} per batch |",
        "| length curriculum | " + (", ".join(f"{n:,}" for n in mix["lengths"]) + " tokens, equal parts of the schedule, "
                                    "tokens per step kept |" if mix.get("lengths") else "none |"),
        f"| gap | {mix['gap']} filler tokens between the pairs and the query region |",
        "",
        *_model_md(m, attention=False),
        *_training_rows(run),
        f"| seed | {t['seed']} |",
        "",
        "## Results",
        "",
        f"Held-out rows of the training mix (another key stream), at the training length {t['seq_len']:,}, through "
        f"the training forward (fp32, chunked): loss {_fmt(f['heldout_loss'])} nats on the queried values, "
        f"**accuracy {_fmt(f['recall_accuracy'])}** over {f['heldout_rows']} rows. By kind of row (each alone, "
        f"{f['heldout_rows']} rows or more):",
        "",
        "| rows | accuracy |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {a:.4f} |" for k, a in f["accuracy_by_pairs"].items()]
    lines += ["", "Accuracy curve (held-out rows at each evaluation):", ""] + _eval_table(run["history"])
    lines += ["", "![accuracy curve](accuracy_curve.png)", "", "![loss curve](loss_curve.png)", "",
              "## Decay spectrum", ""]
    lines += [x.replace("held-out tokens", "tokens of held-out task rows") for x in _spectrum_md(run["spectrum"])]
    lines += ["", "![decay spectrum](decay_spectrum.png)", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- fingerprints


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sha256sums(folder) -> Path:
    """``SHA256SUMS`` (``sha256sum -c`` format) over every other regular file in ``folder``,
    written atomically."""
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != SUMS_FILE and not p.name.startswith("."))
    text = "".join(f"{_sha256(folder / n)}  {n}\n" for n in names)
    tmp = folder / f".{SUMS_FILE}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / SUMS_FILE)
    return folder / SUMS_FILE


def check_sha256sums(folder) -> list[str]:
    """Problems with a folder's ``SHA256SUMS``: files missing, changed, or not listed (empty when
    every file matches)."""
    folder = Path(folder)
    sums = folder / SUMS_FILE
    if not sums.exists():
        return [f"{sums} does not exist"]
    listed, problems = {}, []
    for line in sums.read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    for name, digest in listed.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: listed but missing")
        elif _sha256(path) != digest:
            problems.append(f"{name}: sha256 differs from {SUMS_FILE}")
    for p in folder.iterdir():
        if p.is_file() and p.name != SUMS_FILE and not p.name.startswith(".") and p.name not in listed:
            problems.append(f"{p.name}: not listed in {SUMS_FILE}")
    return problems


__all__ = [
    "LONG_MEMORY",
    "SUMS_FILE",
    "check_sha256sums",
    "decay_spectrum",
    "plot_loss_curve",
    "plot_spectrum",
    "render_training_md",
    "spectrum_values",
    "write_sha256sums",
]

"""Where a fine-tuned language-model base is surprised when a task's responses carry narration: `austen-gpt2` fine-tuned z-free
on sorting responses narrated in its own words (`narrate`: a sentence sampled from the model after each step of the trace), then
its surprisal b_t on held-out narrated responses, split into the trace's tokens and the narration's, beside the same model
before fine-tuning.

    python benchmarks/narrated_base.py --out reference/austen-narrated

Writes `profile.json` (the profiles and the shares) and `tokens.csv` (every held-out response token: example, position,
kind, b_t before and after fine-tuning). Figures are printed and written, never asserted.
"""
import argparse
import csv
import json
import time
from pathlib import Path

import torch
import transformers

import basedirected.sorting  # noqa: F401  (registers the task)
from basedirected.backbone import PairRecord, encode_examples, load_backbone, pairs_to_examples, quiet_progress_bars
from basedirected.config import AdaptConfig, FineTuneConfig
from basedirected.backbone import narrate, sample_narration, step_ends, trace_words
from basedirected.fine_tuning import fine_tune_base
from basedirected.machine import environment_record
from basedirected.pretrained import backbone_directory
from basedirected.model import response_nll
from basedirected.surprisal import surprisal_profile
from basedirected.tasks import make_splits, make_task


def narrated_records(task, examples, sentences) -> list[PairRecord]:
    "Each example with its response narrated, sentences taken in order."
    it = iter(sentences)
    return [PairRecord(" ".join(map(str, e.x)), narrate(task, e.y, it), task.strategies[e.strategy]) for e in examples]


def token_surprisal(lm, vocab, examples) -> list[torch.Tensor]:
    "b_t of every response token (its closing token left out) of each example under `lm`, in the base layout."
    out = []
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            part = examples[i:i + 16]
            nll, mask = response_nll(lm, encode_examples(vocab, part))
            out += [nll[j][mask[j]][:len(e.y)].double() for j, e in enumerate(part)]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the directory to write (new)")
    p.add_argument("--steps", type=int, default=1000, help="fine-tuning steps (full fine-tuning, batch 16, peak learning rate 1e-3)")
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-eval", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens sampled per narration draw, before the cut at its first sentence")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out); out.mkdir(parents=True, exist_ok=False)
    t0 = time.perf_counter()
    task, where = make_task("sorting"), backbone_directory("austen-gpt2")
    train, held = make_splits(task, a.n_train, a.n_eval, a.seed)
    with quiet_progress_bars():
        lm_plain = transformers.AutoModelForCausalLM.from_pretrained(where, local_files_only=True).eval()
        tok_plain = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    slots = sum(len(step_ends(e.y)) for e in train + held)
    sentences = sample_narration(lm_plain, tok_plain, task, slots, max_tokens=a.max_tokens, seed=a.seed)
    t_narration = time.perf_counter() - t0
    lm, vocab = load_backbone(where, n_latent=len(task.strategies))
    train_ex, _ = pairs_to_examples(vocab, narrated_records(task, train, sentences), task.strategies)
    held_records = narrated_records(task, held, sentences[sum(len(step_ends(e.y)) for e in train):])
    held_ex, _ = pairs_to_examples(vocab, held_records, task.strategies)
    before = token_surprisal(lm.eval(), vocab, held_ex)
    t1 = time.perf_counter()
    lm, losses = fine_tune_base(lm, vocab, train_ex, FineTuneConfig(steps=a.steps, mode="full", batch_size=16, lr=1e-3), AdaptConfig(), seed=a.seed, progress=True)
    t_fine = time.perf_counter() - t1
    after = token_surprisal(lm, vocab, held_ex)
    own = trace_words(task)
    kinds = [[("trace" if t.replace("Ġ", "") in own else "narration") for t in e.y] for e in held_ex]
    rows = [{"example": i, "position": t, "kind": k, "b_before": round(b0[t].item(), 6), "b_after": round(b1[t].item(), 6)}
            for i, (ks, b0, b1) in enumerate(zip(kinds, before, after)) for t, k in enumerate(ks)]
    def summary(key):
        b = torch.tensor([r[key] for r in rows], dtype=torch.float64)
        trace = torch.tensor([r["kind"] == "trace" for r in rows])
        return {**surprisal_profile(b), "trace_tokens": int(trace.sum()), "narration_tokens": int((~trace).sum()),
                "mean_b_trace": b[trace].mean().item(), "mean_b_narration": b[~trace].mean().item(), "trace_share_of_total": (b[trace].sum() / b.sum()).item()}
    env = environment_record(a.seed)
    result = {"command": "python benchmarks/narrated_base.py " + " ".join(argv or __import__("sys").argv[1:]),
              "steps": a.steps, "n_train": a.n_train, "n_eval": a.n_eval, "max_tokens": a.max_tokens, "seed": a.seed,
              "narration_sentences": len(sentences), "example_response": held_records[0].response,
              "before_fine_tuning": summary("b_before"), "after_fine_tuning": summary("b_after"), "final_loss": sum(losses[-50:]) / len(losses[-50:]),
              "seconds": {"narration": round(t_narration, 1), "fine_tuning": round(t_fine, 1), "total": round(time.perf_counter() - t0, 1)},
              "made": {"revision": env["git_revision"], "dirty": env["git_dirty"], "cpu": env["cpu"], "threads": torch.get_num_threads()}}
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "tokens.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0])); w.writeheader(); w.writerows(rows)
    print(json.dumps({k: result[k] for k in ("before_fine_tuning", "after_fine_tuning", "seconds")}, indent=1))


if __name__ == "__main__":
    main()

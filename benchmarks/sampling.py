"""What incremental decoding saves when a backbone samples responses: `sample_responses` on a shipped language model with its cache
(`HFCausalLM.decode_step`, each token computed once) and without it (every step a full pass over the sequence so far), on the
same inputs and seed, timed in one process, alternating so that both meet the same machine.

    python benchmarks/sampling.py --rows 32 --tokens 160

Figures are printed, never asserted; compare them as ratios within one run.
"""
import argparse
import time

import torch

import basedirected.sorting  # noqa: F401  (it registers its task)
from basedirected.backbone import load_backbone
from basedirected.base import sample_responses
from basedirected.pretrained import backbone_directory
from basedirected.tasks import make_task


class FullPass(torch.nn.Module):
    "The same model without `decode_step`: `sample_responses` recomputes the whole sequence at every token."
    def __init__(self, model): super().__init__(); self.model = model
    def forward(self, ids): return self.model(ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", default="austen-gpt2", help="a shipped language model's name or a saved model's directory")
    p.add_argument("--rows", type=int, default=32, help="responses sampled at once (sorting inputs)")
    p.add_argument("--tokens", type=int, default=160, help="tokens per response (the budget; an untuned model rarely stops earlier)")
    p.add_argument("--repeats", type=int, default=2, help="timings of each way, alternating")
    a = p.parse_args(argv)
    lm, vocab = load_backbone(backbone_directory(a.backbone))
    xs = [e.x for e in make_task("sorting").generate(a.rows, 0)]
    seconds = {"cached": [], "full pass": []}
    for _ in range(a.repeats):
        for name, model in (("cached", lm), ("full pass", FullPass(lm))):
            t0 = time.perf_counter()
            ys = sample_responses(model, vocab, xs, max_len=a.tokens, seed=0)[0]
            seconds[name].append(time.perf_counter() - t0)
    tokens = sum(map(len, ys))
    for name, s in seconds.items(): print(f"{name:9s} best of {a.repeats}: {min(s):7.2f} s  ({tokens / min(s):7.0f} tokens/s, {tokens} tokens in {a.rows} rows)")
    print(f"full pass / cached: {min(seconds['full pass']) / min(seconds['cached']):.1f}x on {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()

"""Run lm-evaluation-harness against tierlm and against its own transformers backend, and compare.

    python -m venv --system-site-packages /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]" accelerate
    python tools/lm_eval_check.py --lm-eval /tmp/lmeval/bin/lm_eval [--model DIR]

Two small local tasks (no hub access): a 4-way multiple choice (loglikelihood requests: `echo`,
`logprobs`, batched token prompts on /v1/completions) and a greedy generate_until (batched text
prompts, stop strings). lm-eval's `local-completions` talks to a `tierlm serve` started here on
the checkpoint (default: the built-in demo model); its `hf` backend runs the same checkpoint in
transformers. Prints the largest loglikelihood difference and how many is_greedy flags, picks and
generations agree; exits non-zero if they do not agree (logprobs within 1e-3).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
               "metric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_target: \"{{choices[answer]}}\"\n"
                "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
}


def write_tasks(root: Path) -> None:
    rng = random.Random(0)
    words = "cache block token prefix tenant model server request stream batch device host disk remote policy".split()
    rows = [{"question": "Q: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "\nA:",
             "choices": [" " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(4)],
             "answer": rng.randrange(4)} for _ in range(24)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, body in TASKS.items():
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'data.jsonl'}\n"
            f"test_split: test\ndoc_to_text: \"{{{{question}}}}\"\n{body}")


def samples(out: Path, task: str) -> dict[int, dict]:
    path = sorted(glob.glob(str(out / "*" / f"samples_{task}_*.jsonl")))[-1]
    return {row["doc_id"]: row for row in map(json.loads, open(path))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the built-in demo model)")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    if args.model is None:
        from tierlm.models.demo import ensure_demo_model
        args.model = str(ensure_demo_model())
    work = Path(tempfile.mkdtemp(prefix="tierlm-lmeval-"))
    write_tasks(work)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    common = ["--tasks", "tiny_mc,tiny_gen", "--include_path", str(work), "--batch_size", "8", "--log_samples"]
    server = subprocess.Popen([sys.executable, "-m", "tierlm.cli", "serve", "--model", f"m={args.model}",
                               "--port", str(args.port), "--device", "cpu", "--dtype", "float32"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):  # the server loads the model (seconds)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("tierlm serve did not become ready in 120 s")
        url = f"http://127.0.0.1:{args.port}/v1/completions"
        subprocess.run([args.lm_eval, "--model", "local-completions", "--model_args",
                        f"model=m,base_url={url},tokenizer_backend=huggingface,tokenizer={args.model},"
                        "tokenized_requests=True,num_concurrent=1,max_retries=1",
                        *common, "--output_path", str(work / "tierlm")], check=True, env=env)
    finally:
        server.terminate()
        server.wait()
    subprocess.run([args.lm_eval, "--model", "hf", "--model_args", f"pretrained={args.model},dtype=float32",
                    *common, "--output_path", str(work / "hf")], check=True, env=env)
    ours, theirs = samples(work / "tierlm", "tiny_mc"), samples(work / "hf", "tiny_mc")
    pairs = [(a[0], b[0]) for d in ours for a, b in zip(ours[d]["resps"], theirs[d]["resps"])]
    worst = max(abs(float(a[0]) - float(b[0])) for a, b in pairs)
    greedy = sum(a[1] == b[1] for a, b in pairs)
    picks = sum(ours[d]["acc"] == theirs[d]["acc"] for d in ours)
    g_ours, g_theirs = samples(work / "tierlm", "tiny_gen"), samples(work / "hf", "tiny_gen")
    same = sum(g_ours[d]["resps"][0][0] == g_theirs[d]["resps"][0][0] for d in g_ours)
    print(f"loglikelihoods: {len(pairs)}, largest difference {worst:.2e}; is_greedy equal {greedy}/{len(pairs)}; "
          f"picks equal {picks}/{len(ours)}; generations identical {same}/{len(g_ours)}")
    return 0 if worst < 1e-3 and greedy == len(pairs) and picks == len(ours) and same == len(g_ours) else 1


if __name__ == "__main__":
    sys.exit(main())

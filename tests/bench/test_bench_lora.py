"""`tierlm bench lora` end to end at tiny scale: tierlm with mixed adapters, tierlm on the base
model and transformers + peft run the same prompts; tierlm's answers are peft's, token for
token, and the ratios are what the timings say."""
from __future__ import annotations

import json

from tierlm.cli import main


def test_bench_lora_tiny(llama_dir, tmp_path):
    out, plot = tmp_path / "lora.json", tmp_path / "lora.png"
    rc = main(["bench", "lora", "--model", str(llama_dir), "--adapter-dir", str(tmp_path / "adapters"),
               "--adapters", "3", "--rank", "4", "--prompts", "5", "--min-prompt", "8", "--max-prompt", "20",
               "--max-tokens", "6", "--hf-batch", "2", "--kv-cache-memory", str(4 << 20), "--device", "cpu",
               "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["prompts"] == 5 and res["adapters"] == 3 and res["rank"] == 4
    for who in ("tierlm", "tierlm_base", "peft"):
        assert res[who]["output_tokens"] == 5 * 6
    assert res["identical_answers"] == 5  # the adapters are applied as peft applies them
    assert res["changed_by_adapters"] >= 3  # (and they do change the answers)
    assert res["ratio_vs_peft"] == res["tierlm"]["tok_per_s"] / res["peft"]["tok_per_s"]
    assert res["adapter_cost"] == res["tierlm"]["tok_per_s"] / res["tierlm_base"]["tok_per_s"]
    assert plot.stat().st_size > 1000

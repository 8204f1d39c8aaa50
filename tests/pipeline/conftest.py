import json

import pytest
import yaml

TINY = {
    "name": "tiny", "seed": 3, "threads": 1,
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
              "vocab_size": 400, "tokenizer_corpus": 100},
    "domains": [
        {"name": "arith", "env": "arith", "group_size": 2, "max_new_tokens": 8},
        {"name": "agent", "env": "toolcalc", "group_size": 2, "max_new_tokens": 8, "max_turns": 2},
    ],
    "train": {"steps": 6, "groups_per_step": 3, "checkpoint_every": 3, "keep_checkpoints": 3, "micro_batch": 4,
              "max_refill_rounds": 1},
    "sft": {"steps": 2, "batch_size": 4, "examples_per_domain": 8},
    "eval": {"tasks_per_domain": 2, "n": 2},
}


@pytest.fixture
def tiny_config(tmp_path):
    def write(**changes) -> str:
        data = yaml.safe_load(yaml.safe_dump(TINY))
        data["run_dir"] = str(tmp_path / "runs")
        # An untrained policy passes this about half the time, so RL has a signal from step 1.
        records = tmp_path / "no_e.jsonl"
        records.write_text("\n".join(json.dumps({"prompt": f"Say anything without the letter e ({i}).",
                                                 "answer": "[^e]*", "reference": "ok"}) for i in range(4)))
        data["domains"] = data["domains"] + [{"name": "no_e", "env": "jsonl", "group_size": 4, "max_new_tokens": 6,
                                              "env_args": {"path": str(records), "matcher": "regex"}}]
        data["allow_unchecked"] = ["no_e"]  # a test's data file, never QA-checked: allowed, and recorded
        data.update(changes)
        path = tmp_path / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return write

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
    "train": {"steps": 6, "groups_per_step": 2, "checkpoint_every": 3, "keep_checkpoints": 3, "micro_batch": 4,
              "max_refill_rounds": 1},
    "sft": {"steps": 2, "batch_size": 4, "examples_per_domain": 8},
    "eval": {"tasks_per_domain": 2, "n": 2},
}


@pytest.fixture
def tiny_config(tmp_path):
    def write(**changes) -> str:
        data = yaml.safe_load(yaml.safe_dump(TINY))
        data["run_dir"] = str(tmp_path / "runs")
        data.update(changes)
        path = tmp_path / f"{data['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return write

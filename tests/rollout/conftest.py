import pytest
import torch

from assay.core.config import ModelConfig
from assay.core.modeling import build_model
from assay.core.tokenizer import train_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    corpus = [f"<|im_start|>user\nWhat is {i}+{2 * i}?<|im_end|>\n<|im_start|>assistant\n{3 * i}<|im_end|>\n"
              for i in range(200)]
    return train_tokenizer(corpus, 320)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      max_position=256)
    return build_model(cfg, tok)

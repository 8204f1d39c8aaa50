import pytest
import torch
from agent_fakes import calc_task, reference

from assay.core.tokenizer import render_messages, train_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok():
    corpus = []
    for a in range(60):
        t = calc_task(a, 7 * a)
        corpus.append(render_messages(t.prompt + reference(t), t.tools))
    return train_tokenizer(corpus, 360)

"""The pools' model server (deployments.workers): where its torch work runs."""

from __future__ import annotations

import asyncio
import threading

import deployments.workers as workers
from specdec.params import SamplingParams
from specdec.processing import RequestSampling
from specdec.rounds import ScoreCall


def test_the_model_is_loaded_and_run_on_one_thread(tiny_pair, monkeypatch):
    """Passes on another thread than the one that loaded the model took 1.2-1.3x as long
    in the service on a 2-core CPU (two OpenMP teams): loading and every call share one."""
    threads: dict[str, set[int]] = {"load": set(), "extend": set()}

    class RecordingRunner(workers.ModelRunner):
        def __init__(self, *args, **kwargs):
            threads["load"].add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def extend(self, items):
            threads["extend"].add(threading.get_ident())
            return super().extend(items)

    monkeypatch.setattr(workers, "ModelRunner", RecordingRunner)
    server = workers.Target.func_or_class({"model": str(tiny_pair[1]), "dtype": "float32"})
    params = SamplingParams(temperature=0.0, max_tokens=4)
    sampling = RequestSampling(params, prompt_ids=(1, 2, 3))

    async def score():
        return await server.score(ScoreCall("r", [1, 2, 3], 0, sampling))

    scores = asyncio.run(score())
    assert scores.probs is not None
    assert threads["load"] == threads["extend"] and len(threads["load"]) == 1
    assert threads["load"] != {threading.get_ident()}

"""SRV-142: what crosses between the server's process and its engine process comes back whole.

Errors: every ``PagedKVError`` subclass pagedkv defines, pickled, is the same class with the
same message and attributes (an exception's default pickling calls ``__init__`` with the
message alone, so those taking other arguments failed to unpickle, or took the message for
another argument). Outputs: a ``RequestOutput`` with sampled and prompt logprobs is equal once
pickled, its token texts included (a ``Logprob`` decodes lazily through a function of the
engine's process, which cannot be pickled).

Mutants killed: ``PagedKVError.__reduce__`` removed (``OutOfPages``, ``QueueFull`` and the
others with their own ``__init__`` fail to unpickle); ``Logprob.__reduce__`` removed (the
output does not pickle); ``Logprob.__reduce__`` keeping the text undecoded (the texts differ).
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import pagedkv
from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.outputs import PositionLogprobs, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.errors import PagedKVError

#: Arguments of the errors whose ``__init__`` takes more (or other) than a message.
CUSTOM_ARGS: dict[str, tuple[object, ...]] = {
    "OutOfPages": (3, 1),
    "UnknownSequence": (7,),
    "DoubleFree": (7,),
    "DuplicateSequence": (7,),
    "PagesInUse": (5,),
    "WorkerFailed": ("rank 1 died", 1, -9),
    "PayloadTooLarge": (1024,),
    "QueueFull": ("the queue is full", 2),
    "TextTooLong": ("the prompt is too long", "prompt"),
}


def _all_errors() -> list[type[PagedKVError]]:
    """Every subclass of ``PagedKVError`` defined in pagedkv (its modules imported first)."""
    for module in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        if ".native" in module.name or "_kernels" in module.name or ".cuda" in module.name:
            continue  # compiled or GPU-only modules define no errors
        try:
            importlib.import_module(module.name)
        except ImportError:  # an optional backend's module (triton, ...)
            continue
    found: list[type[PagedKVError]] = []
    todo = [PagedKVError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("pagedkv.") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


ERRORS = _all_errors()


def test_errors_were_found() -> None:
    names = {cls.__name__ for cls in ERRORS}
    assert {"InvalidRequest", "OutOfPages", "QueueFull", "WorkerFailed"} <= names
    assert {"EngineFailure", "EngineUnavailable", "RequestFailed"} <= names


@pytest.mark.spec("SRV-142")
@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_crosses_whole(cls: type[PagedKVError]) -> None:
    args = CUSTOM_ARGS.get(cls.__name__, ("something went wrong",))
    try:
        error = cls(*args)
    except TypeError as exc:  # a new error with its own __init__: give it arguments above
        pytest.fail(f"{cls.__name__} needs an entry in CUSTOM_ARGS: {exc}")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert back.args == error.args
    assert back.__dict__ == error.__dict__


def _outputs_with_logprobs() -> list[RequestOutput]:
    engine = reference_backend().load_engine(None, EngineConfig(num_pages=32, page_size=16))
    assert engine.tokenizer is not None
    params = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1, temperature=0)
    engine.add_request(engine.tokenizer.encode("def add(a, b):"), params, request_id="r")
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


@pytest.mark.spec("SRV-142")
def test_outputs_cross_whole_with_their_token_texts() -> None:
    outputs = _outputs_with_logprobs()
    back = pickle.loads(pickle.dumps(outputs))
    assert back == outputs
    last, last_back = outputs[-1], back[-1]
    sampled = last.outputs[0].logprobs
    assert sampled is not None
    assert last_back.outputs[0].logprobs is not None
    for position, position_back in zip(sampled, last_back.outputs[0].logprobs, strict=True):
        assert isinstance(position_back, PositionLogprobs)
        assert position_back.entry == position.entry
        texts = {t: lp.decoded_token for t, lp in position.items()}
        assert texts == {t: lp.decoded_token for t, lp in position_back.items()}
        assert all(isinstance(text, str) for text in texts.values())
    assert last_back.prompt_logprobs == last.prompt_logprobs

"""What a model's finalize leaves: `triton_glue.release_python_objects` frees the model's objects while the stub is
whole (tritonserver 2.51's stub segfaulted freeing metric families and response senders at interpreter exit)."""

import time

from omni_backend.stages.triton_glue import RELEASE_AFTER_S, Retired, release_python_objects


class Tracked:
    """Records its name in `freed` when Python frees it."""

    def __init__(self, name: str, freed: list):
        self.name, self.freed = name, freed

    def __del__(self):
        self.freed.append(self.name)


def test_release_frees_retired_senders_and_objects_in_cycles_at_once():
    freed: list[str] = []
    model = type("Model", (), {})()
    model.retired = Retired()
    model.retired.add(Tracked("sender", freed))  # its thread would keep it RETIRE_AFTER_S
    family = Tracked("family", freed)
    family.itself = family  # a cycle: only the garbage collector frees it, at exit if nobody runs it
    model.metrics = family
    del family
    started = time.monotonic()
    release_python_objects(model)
    assert sorted(freed) == ["family", "sender"] and vars(model) == {}
    assert time.monotonic() - started >= RELEASE_AFTER_S * 0.9  # the newest sender was given its grace


def test_release_of_an_empty_retired_does_not_wait():
    started = time.monotonic()
    Retired().release()
    assert time.monotonic() - started < RELEASE_AFTER_S / 2

"""Asynchronous saves for the Lightning plug-in: :class:`StoreCheckpointIO`
on Lightning's background-thread ``AsyncCheckpointIO``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

from ...errors import CkptStoreError, InvalidInputError
from ...torch.codec import flatten
from .checkpoint_io import StoreCheckpointIO
from .files import mark_done, mark_in_flight

__all__ = ["AsyncStoreCheckpointIO"]


class AsyncStoreCheckpointIO(AsyncCheckpointIO):
    """:class:`StoreCheckpointIO` with saves on a background thread.

    Lightning's ``AsyncCheckpointIO`` copies the tensors on the calling thread
    and writes on one worker. Here the checkpoint's path is also *reserved* on
    the calling thread (a small reservation file, replaced atomically by the
    pointer once the save is committed, removed if the save fails), so that
    ``ModelCheckpoint``'s version naming (``-v1``, ``-v2``), which checks
    whether the file exists before the next save, never picks the path of a
    save still in flight and overwrites it. A reservation left by a killed
    process holds no checkpoint: loading it raises :class:`NotFoundError`
    naming the fix. ``remove_checkpoint`` is queued behind the
    pending saves (a top-k removal never overtakes the save of the file it
    removes) and ``load_checkpoint`` waits for them. A failed background save
    is raised at the next call or at ``teardown``.
    """

    _error: BaseException | None  # set by Lightning's base class and by the queued removals

    def __init__(self, checkpoint_io: StoreCheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else StoreCheckpointIO(**kwargs))

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Refuse an unrepresentable object now, on the caller's thread (with its key path);
        then copy the tensors and write in the background."""
        checkpoint = kwargs["checkpoint"] if "checkpoint" in kwargs else args[0]
        inner = self.checkpoint_io
        assert isinstance(inner, StoreCheckpointIO)
        for key, value in checkpoint.items() if isinstance(checkpoint, Mapping) else []:
            try:
                flatten(value, registry=inner.registry)
            except InvalidInputError as exc:
                msg = str(exc)
                raise InvalidInputError(
                    f"checkpoint[{key!r}]" + msg[len("state"):] if msg.startswith("state") else msg
                ) from None
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        path = kwargs["path"] if "path" in kwargs else args[1] if len(args) > 1 else None
        if isinstance(step, int) and not isinstance(step, bool) and path is not None:
            try:
                if inner.reserve(path, step):  # the path is taken now, as after a synchronous save (see reserve)
                    mark_in_flight(path)  # a load of it in this process waits for the queued save
            except (OSError, CkptStoreError):
                pass  # the path cannot be written: the save itself fails on it, reported at the next call
        earlier = self._error
        try:
            super().save_checkpoint(*args, **kwargs)
        except BaseException as exc:
            if path is not None and exc is not earlier:  # refused before it was queued: nothing will replace it
                inner.release(path)
                mark_done(path)
            raise

    def _run_in_order(self, fn: Callable[[], Any]) -> Any:
        """``fn`` after every queued save (now, when nothing was ever queued: no thread is made)."""
        if self._executor is None:
            return fn()
        return self._executor.submit(fn).result()

    def wait(self) -> None:
        """Block until every queued save has finished; raise the first background error.
        The idle worker thread is let go (the next save makes one again), so a
        resumed Trainer holds no thread pool and can be deep-copied."""
        self._run_in_order(lambda: None)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if self._error:
            err, self._error = self._error, None
            raise err

    def __getstate__(self) -> dict[str, Any]:
        """Copies (``copy.deepcopy`` of a Trainer, ``ddp_spawn``) carry no thread pool and no pending error."""
        state = dict(self.__dict__)
        state.update(_executor=None, _error=None)
        return state

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        inner = self.checkpoint_io
        assert inner is not None
        if self._executor is None:  # nothing queued: remove now, on the caller's thread
            inner.remove_checkpoint(*args, **kwargs)
            return

        def _remove() -> None:
            try:
                inner.remove_checkpoint(*args, **kwargs)
            except BaseException as ex:  # noqa: BLE001 - raised at the next call, like a failed save
                self._error = ex

        self._executor.submit(_remove)
        if self._error:
            raise self._error

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        inner = self.checkpoint_io
        assert inner is not None
        loaded: dict[str, Any] = inner.load_checkpoint(*args, **kwargs)
        return loaded

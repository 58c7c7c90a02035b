"""Several generations in one request (``prompt`` an array: lm-eval's and LangChain's batches; ``n`` choices a
prompt): their streams run side by side as concurrent requests (the Runner batches their steps as it batches
separate clients'), and answer as one: all or none. One that fails fails the request, and the others are
cancelled (freed as a client gone is).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def all_or_none(awaitables: list[Awaitable[T]]) -> list[T]:
    """Each awaitable's result, in order, run concurrently; the first failure cancels the others (waited for,
    so they are freed before this returns) and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        pending = set(tasks)
        while pending:  # not FIRST_EXCEPTION: a task cancelled under it is no exception there, and it waited on
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.index):
                task.result()  # raises its failure, or CancelledError for a task cancelled from elsewhere
        return [t.result() for t in tasks]
    finally:
        await _cancelled(tasks)


async def merged(streams: list[AsyncIterator[T]], hold: int | None = None) -> AsyncIterator[tuple[int, T]]:
    """The items of ``streams`` as they come, each with its stream's index. Nothing is yielded before each of the
    first ``hold`` streams (default: all) has given its first item (or ended): a refusal before a prompt's first
    token (the context too long) is raised before the first event, a proper HTTP error; streams after them (a
    batch's choices waiting for a slot, which may free only when the first ones end) do not hold the others' text
    back, and fail mid-stream. A stream's failure cancels the others and is raised; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:  # closed with this, not when a garbage collection finds it
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except BaseException as exc:  # handed to the reader, which raises it: a CancelledError from inside the
            # stream too (the reader waited forever for it); this pump's own cancel (``_cancelled``) goes on up
            if asyncio.current_task().cancelling():
                raise
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    held: list[tuple[int, T]] | None = []  # until the first ``hold`` streams have started; then None
    started, open_streams = set(), len(streams)
    waited = set(range(len(streams) if hold is None else max(1, min(hold, len(streams)))))
    try:
        while open_streams:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            started.add(index)
            if item is _END:
                open_streams -= 1
            elif held is None:
                yield index, item
            else:
                held.append((index, item))
            if held is not None and waited <= started:
                for index_item in held:
                    yield index_item
                held = None
    finally:
        await _cancelled(tasks)


async def _cancelled(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

"""Script calls issued in one turn of the event loop, sent to Redis as one pipeline.

Under load every stream commits each step on its own (core/redis_store.py), so a verifier batch of
many sessions ends in as many script calls in the same instant. Sent one by one, each costs a round
trip, a send and a reply parse; gathered here, they cost one of each. Each caller still awaits its
own reply (a commit is still done before its stream shows the tokens); a call's error is its own,
and a connection that fails fails every call of that pipeline, as it would have failed each alone.
"""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript


class ScriptBatcher:
    """``await batcher.call(script, keys, args)``: the script's reply, its call sent in the pipeline
    of every call made before the event loop's next turn."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._pending: list[tuple[AsyncScript, list, list, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)

    async def call(self, script: AsyncScript, keys: list, args: list):
        future = asyncio.get_running_loop().create_future()
        self._pending.append((script, keys, args, future))
        if len(self._pending) == 1:  # the first of this turn: the send starts once the others are in
            task = asyncio.ensure_future(self._send())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return await future

    async def _send(self) -> None:
        calls, self._pending = self._pending, []
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for script, keys, args, _ in calls:
                    await script(keys=keys, args=args, client=pipe)  # queued: the pipeline loads the scripts Redis lacks
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # the connection failed (or this task was cancelled): every call hears it
            for *_, future in calls:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else ConnectionError("the pipeline was cancelled"))
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, future), reply in zip(calls, replies):
            if future.done():  # its caller went away (a cancelled stream): the commit landed anyway
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

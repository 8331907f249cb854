"""The scheduler's waiting queue, in the order of its policy.

``fcfs``: arrival order; a preempted request goes back to the front, so it resumes before
requests that arrived after it. ``priority``: lowest ``priority`` value first, then earliest
arrival; a preempted request simply re-enters at its rank.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedserve.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        # Entries (priority, arrival_time, tie-breaker, request); the counter keeps equal keys
        # in insertion order and stops heapq from ever comparing two Requests.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in scheduling order."""
        return (entry[3] for entry in sorted(self._heap))


RequestQueue = FCFSQueue | PriorityQueue


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"policy: {policy!r} is not fcfs or priority")


def check_priority(policy: str, priority: int) -> None:
    """Refuse a priority that the scheduling policy would silently ignore."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: expected an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority: needs --policy priority (the scheduling policy is {policy}); got {priority}"
        )

"""An exponentially weighted least-squares line, y = a + b * x: the one fit behind the verifier's
per-row batch cost (core/goodput.py) and a request's verify time per draft token (core/speculation.py).
Callers decide what to assume while x has hardly varied. Pure."""
from __future__ import annotations


class EwLine:
    def __init__(self, rate: float) -> None:
        self._keep = 1.0 - rate
        self.n = 0.0  # the weight of what was seen (0: nothing yet)
        self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = self._keep
        self.n = keep * self.n + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y

    @property
    def mean_x(self) -> float:
        return self._x / self.n

    @property
    def mean_y(self) -> float:
        return self._y / self.n

    @property
    def var_x(self) -> float:
        mx = self.mean_x
        return self._xx / self.n - mx * mx

    @property
    def slope(self) -> float:
        """Least-squares slope; only meaningful once ``var_x`` is clear of 0."""
        return (self._xy / self.n - self.mean_x * self.mean_y) / self.var_x

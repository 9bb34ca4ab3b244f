"""Shared maths of the algorithms, each piece once: named-tensor arithmetic, consensus variates
(Eqs. 9-12), meta-gradients (FO / FD-HVP), functional optimizers, schedules, wire codec, state store."""

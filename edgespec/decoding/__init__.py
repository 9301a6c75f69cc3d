"""The speculative core: one cycle and a generation's steps (loop), verification (verify), sampling and the
rules that shape every row (sampling, rules), choosing K (policy) and what passes cost (costs)."""

"""The target spread over llama.cpp RPC workers on other machines, the proposer kept local: probing workers
(probe), running one (worker), and the target in a child process that a lost worker cannot take down (target)."""

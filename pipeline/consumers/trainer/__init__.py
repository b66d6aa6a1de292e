"""The trainer stage: the loop (``loop``) and its process entry (``main``), the drain under the staleness policy and the
group filters, the ledger and the commit protocol (a step's entries are acknowledged with its checkpoint), the audit,
checkpoints and weight snapshots, offline replay, hooks, per-step metrics and profiling."""

"""The demo bank: a service whose database is a materialized view of the Waltz log.

* :mod:`demo.bank.model`: the accounts table, the transaction contexts (deposit, withdraw, deactivate) and the
  callbacks that apply committed transactions to the database (through ``SqlClientCallbacks``);
* :mod:`demo.bank.app`: one application instance (its own client and database);
* :mod:`demo.bank.auto`: the automatic mode: several instances submitting random operations at once, a live
  progress display, and the invariant checks;
* ``python -m demo.bank``: the command line (interactive or automatic).
"""

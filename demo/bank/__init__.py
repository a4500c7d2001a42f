"""The demo bank: a service whose database is a materialized view of the Waltz log.

* :mod:`demo.bank.model`: the accounts table, the transaction contexts (deposit, withdraw, deactivate) and the
  callbacks that apply committed transactions to the database (through ``SqlClientCallbacks``);
* :mod:`demo.bank.app`: one application instance (its own client and database);
* :mod:`demo.bank.auto`: the automatic mode: several instances submitting random operations at once, a live
  progress display, and the invariant checks;
* :mod:`demo.bank.snapshot`: a consistent snapshot of an instance's database at its high-water marks, the trim
  below it, and a new instance's database loaded from it (bootstrap);
* :mod:`demo.bank.bootstrap`: the snapshot, trim and bootstrap drill ``make demo`` runs;
* ``python -m demo.bank``: the command line (interactive, automatic, or ``snapshot``).
"""

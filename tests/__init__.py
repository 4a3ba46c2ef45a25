"""dcpstore's test suite: one folder per kind of test (the README's Layout
says which), and ``tests.support``, what the tests share. A package so that
every test imports what it shares by its full name (``tests.support.faults``)
from the repository root, the one entry pytest's ``pythonpath`` adds."""

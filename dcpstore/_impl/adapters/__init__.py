"""The parts of :mod:`dcpstore.adapters` that are not its surface: Megatron's
state-dict formats, Bridge's async writer and what runs in its worker,
``install_in_bridge``'s hooks, and the drop-ins' options."""

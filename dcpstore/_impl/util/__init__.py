"""The foundation: what every layer above uses and nothing of dcpstore's
below it -- the exception family (:mod:`.errors`), daemon threads
(:mod:`.threads`), known warnings kept quiet while our own call runs
(:mod:`.warning_filters`), byte sizes for people (:mod:`.units`), keyword
mistakes named with their fix (:mod:`.keyword_hints`), progress bars
(:mod:`.progress`), names imported on first use (:mod:`.lazy_names`), whether
torch.distributed is running (:mod:`.distributed`), gloo groups of dcpstore's
own (:mod:`.groups`) and every name torch
does not publish (:mod:`.torch_compat`)."""

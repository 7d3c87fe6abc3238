"""Where runs are kept and found: the run store (:mod:`.store` writes, :mod:`.store_reader` reads),
registration for Prometheus' file-based discovery (:mod:`.discovery`, :mod:`.procinfo`), the local
Prometheus + Alertmanager stack of ``rlwatch up`` (:mod:`.stack`) and the files shipped with the code
(:mod:`.resources`)."""

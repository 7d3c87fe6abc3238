"""The paging policy, as the runbook states it (its first section): what pages, what goes to chat,
how an alert reaches Prometheus and Alertmanager, and the figures the acceptance report measured."""

PAGING_POLICY = """## Paging policy

The catalogue enforces it; `tests/test_alert_rules.py` and the acceptance report check it.

- **critical pages a person, who should act now.** Only these are critical: a collapse predictor at a
  magnitude that matters (k3 above `kl_k3_max` for consecutive steps, a degenerate importance-weight
  ESS, a maximum lag far beyond the configured staleness bound), a sampler-semantics fault at the start
  of an on-policy run, a reward-hack rate that is high and rising with statistical evidence, a stopped
  trainer and an exporter that crashed mid-run.
- **warning goes to chat.** Every relative condition (a jump against the run's own baseline, a drift
  score, entropy against its own maximum) and every rate that is worth a look but not a reason to stop.
  A relative jump or drift never pages unless its magnitude also crosses a bound that matters, and
  then it is the bound's critical alert that pages.
- **Evidence before alarm.** No rising or jump condition without a baseline of `baseline_steps` steps
  (`hack_baseline_steps` for hack rates); rates are judged by their Wilson lower confidence bound at
  `evidence_z` (3 of 40 episodes flagged is not evidence of a rate above 5%); the on-policy check
  subtracts `evidence_z` standard errors of the mean log-ratio (from k2 and the token count);
  magnitudes must hold for the alert's steps, consecutive or, for the three critical magnitudes (k3,
  ESS, maximum lag), `intermittent_hits` of the last `intermittent_steps` steps: a fault on every
  second or third step (one replica of several, one of two alternating data sources) pages too.
- **One incident, one page.** An alert opens after its raise condition held for its steps, stays open
  while its looser hold condition holds (a statistic beyond `hold_fraction` of the threshold) and
  resolves `clear_steps` steps after the hold last held. A fault that persists keeps its alert firing;
  the resolved notification carries the statistic's value at that step.
- **One verdict everywhere.** The step windows are computed once per step in the training process and
  exported (`rlwatch_alert_value`, `rlwatch_alert_streak_steps`, `rlwatch_alert_hit_steps`,
  `rlwatch_alert_quiet_steps`, `rlwatch_window_baseline`, `rlwatch_window_stderr`); the process
  decides when an alert opens and resolves, and exports each opening as an incident; the rules only
  read the incidents, as the
  embedded evaluator reads the same transitions, so both fire the same alerts the same number of
  times whether a step takes 1 s or 10 min and whether Prometheus scrapes every step or every 200
  (`tests/test_alert_delivery.py` replays bursts through promtool at 1 to 200 steps per scrape).
  Only the trainer-stalled, exporter-down and hook-error alerts read wall time.
- **Delivery does not depend on sampling.** Each opening is an incident with its own series,
  `rlwatch_alert_incident{alert, ..., incident="<n>", state}`: `state="open"` with the statistic
  while open, then `state="resolved"` with the value it opened with, exported 10 more minutes
  (longer than any scrape interval). The rule fires an open incident, and a resolved one only while
  its series is under 2 minutes old and no scrape saw it open: an incident between two scrapes pages
  once; one seen open resolves at the scrape that shows it resolved. `keep_firing_for: 1m` outlasts
  Alertmanager's group wait, so an incident only the run's last scrape saw still arrives; a run that
  closes with an incident no scrape has seen serves one more scrape (1.5 measured scrape intervals
  + 1 s, at most 60 s; 2 s when /metrics was fetched only once; `Watch.close(scrape_wait=...)`), a Pushgateway run
  pushes it at close with every incident still open marked resolved (the gateway serves that push
  after the run: an open one would page forever, a resolved one pages once if no scrape saw it
  open). Each incident is its own alert (two between two scrapes page twice, as in the process),
  identical on both replicas of an HA pair, which the Alertmanager cluster deduplicates
  (`examples/deploy/ha/`).
- **Run identity.** Every series carries `run` and `run_instance` (one per process:
  `<host>-<pid>-<start>`, or `$RLWATCH_RUN_INSTANCE`), every rule joins `on(run, run_instance)` and a
  Pushgateway groups by both: two processes that share a run name page, chart and push separately.
  The side of a join that must be one series per process is aggregated `by (run, run_instance)`, so
  two targets behind one identity (one `$RLWATCH_RUN_INSTANCE` given to two processes, a target
  scraped by two jobs) page separately by `instance` and never stop another run's alerts.
- **Plumbing.** Exporters register through file_sd (`Watch(sd_dir=...)`, `rlwatch up` sets it) and
  remove their file when their run closes cleanly: a finished run never pages, and RLWatchExporterDown
  fires only for a target that answered in the last hour. The Alertmanager inhibitions only act
  between alerts of the same, non-empty run or instance and never touch RLWatchWatchdog.

Measured (`alerts/acceptance.md`: the full matrix, 20 scenarios x 2 policy families, 360 test runs
on seeds 3-11, thresholds tuned on seeds 0-2). **At the shipped defaults** (`kl_k3_max`=0.1,
`intermittent_hits`=2 of `intermittent_steps`=4, `ess_min`=0.3, set for language models) the toy
policies page 87 times on 162 healthy runs: their k3 between consecutive versions is 10-100x a large
model's; every collapse and semantic fault still pages in time. **At the thresholds tuned for them**
(`kl_k3_max`=1.7, `lag_critical_factor`=1.5, `kl_jump_floor`=1, the rest the defaults): 0 critical
pages on 162 healthy runs and 0 flaps; all 36 runs that collapsed paged before it (median lead 19.5
steps, 0.80 of the steps to the collapse), every intermittent fault (a bad sampler on every second or
third step) critical within 10 steps, every semantic fault critical, the reward-hack alert on the
hacked environment only in the 10 runs where the hack took hold and never on a sound grader, and the
process and Prometheus fired the same alerts with a step every 1 s, 10 s and 10 min. Seeds 9-11 alone
meet every bar too. Warnings are not pages: the
same healthy runs raised 372, mostly entropy collapse, drift and zero-variance groups of toy policies
that sharpen fast.
"""

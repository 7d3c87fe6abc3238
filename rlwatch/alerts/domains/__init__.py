"""The alert catalogue's domains, one module each; :mod:`rlwatch.alerts.catalogue` lists them in
page order."""

"""Parent side: what report plugins receive and the built-in reports (JUnit, trace tables, run summary)."""

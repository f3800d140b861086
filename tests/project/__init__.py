"""The project as a whole: docs and notebooks that run, packaging and the wheel, the
library's layout rules, typed call sites, the suite's own hygiene."""

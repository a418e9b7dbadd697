"""What users run: the command line (`cli`), the paper's benchmark (`bench`, with `bench_report` making its
tables and plots), the section-2 miss analysis (`analysis`) and the TRL GRPOTrainer adapter (`trl_rollout`)."""

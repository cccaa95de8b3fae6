"""Code the tests share, imported as `tests.support.*` (tests/conftest.py holds only fixtures and hooks):
tiny checkpoints (`checkpoints`) and compiled artifacts (`artifacts`); TVM functions built and run on
numpy (`tvm_run`), Relax modules (`relax_modules`) and the kernels the schedule pass sees (`schedules`);
kernel operands (`kernels`) and the int8 plan's inputs (`int8_plans`); the service's answers (`service`)
and commands (`commands`); servers a test starts as modules (`server_*`) and a stand-in for the Hub
(`hub_stand_in`); the CPU capabilities tests require (`capabilities`)."""

"""The tasks a run can do, by their `task=` name.

Each is a protocol.Task: its checks, its run, its record's summary. A new task is one module
here and one line below."""
from .bench import BenchTask
from .calibrate import CalibrateTask
from .comm import CommTask
from .infer import InferTask
from .plan import PlanTask
from .tune import TuneTask

TASKS = {t.name: t for t in (BenchTask, CommTask, TuneTask, InferTask, PlanTask, CalibrateTask)}

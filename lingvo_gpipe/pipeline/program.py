"""A schedule lowered to the program that runs it: every instruction, transfers included.

The Schedule (schedule.py) says which action each device runs when; its program is the
list of instructions the executor (executor.py, replicas.py) emits, in that order:

  F, B, W, BW   an action on its chunk's device (schedule_actions.py); W and BW (and a B
                that takes the weight gradients itself) add the micro-batch's weight
                gradients to their chunk's sum (the accumulation);
  L             a micro-batch's loss (or the whole batch's) and its gradient;
  SF(m, c)      send: F(m, c)'s output to chunk c+1, on another device;
  SB(m, c)      send: the input gradient of B(m, c) or BW(m, c) to chunk c-1, on another
                device;

and then the reduction: the gradient sums of every replica added up, the loss and the
gradients divided by the losses' total weight (training_pass.py). A send follows the
action that made its value; it is where TensorFlow moves the value to the next device,
and where the receiver waits for it, copied ahead, when that is the receiver's first
instruction of the pass (executor.Pass._HandOver). The program's timing is the schedule's
under a cost model whose transfers are the sends' delays (cost_model.py): what the
simulator and the planner predict is what the executor runs.

No TensorFlow here.
"""

import dataclasses
import enum
from typing import NamedTuple

from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import schedule_actions


class Send(enum.StrEnum):
  """A transfer's kind; a str, as schedule_actions.Kind."""
  ACTIVATION = 'SF'
  GRADIENT = 'SB'


SEND_ACTIVATION, SEND_GRADIENT = Send


class Instruction(NamedTuple):
  """An action (kind a schedule_actions.Kind) or a send (kind a Send, chunk the sender's) of
  micro-batch `micro_batch` on chunk `chunk`."""
  kind: schedule_actions.Kind | Send
  micro_batch: int
  chunk: int


def Receiver(send: Instruction) -> int:
  """The chunk a send hands its value to."""
  return send.chunk + 1 if send.kind == SEND_ACTIVATION else send.chunk - 1


def _Text(instruction):
  """An instruction as the program's text writes it: F3@0, SF3@0>1, L*@1."""
  if instruction.kind in (SEND_ACTIVATION, SEND_GRADIENT):
    return f'{instruction.kind}{instruction.micro_batch}@{instruction.chunk}>{Receiver(instruction)}'
  return schedule_actions.ActionText(schedule_actions.Action(*instruction))


@dataclasses.dataclass(frozen=True)
class Program:
  """The instructions a Schedule lowers to, in the order the executor emits them."""
  schedule: schedule_lib.Schedule
  instructions: tuple[Instruction, ...]

  @property
  def placement(self) -> list[int]:
    return self.schedule.placement

  def Actions(self) -> list[Instruction]:
    """The schedule's actions (no sends), in program order."""
    return [i for i in self.instructions if isinstance(i.kind, schedule_actions.Kind)]

  def Forwards(self) -> list[Instruction]:
    """The forward pass alone: every F and its send (what an evaluation runs)."""
    return [i for i in self.instructions
            if i.kind in (schedule_actions.FORWARD, SEND_ACTIVATION)]

  def SplitBackwards(self) -> set[tuple[int, int]]:
    """(micro-batch, chunk) pairs whose backward runs as B and W."""
    return {(i.micro_batch, i.chunk) for i in self.instructions
            if i.kind == schedule_actions.WEIGHT_GRAD}

  def Sends(self) -> list[Instruction]:
    return [i for i in self.instructions if i.kind in (SEND_ACTIVATION, SEND_GRADIENT)]

  def Arrays(self) -> cost_model.OrderArrays:
    """Each device's actions in its order, as the timing takes them."""
    return cost_model.ToArrays(self.schedule.orders, self.placement)

  def Time(self, model: cost_model.CostModel):
    """(start, end), each [4, C, M], of every action under `model` (cost_model.Time); the
    sends' delays are the model's transfers."""
    return cost_model.Time(self.Arrays(), model)

  def ToText(self) -> str:
    """One line per instruction: its device and what it does; the reduction last."""
    s = self.schedule
    lines = [f'program {s.name} K={s.num_stages} M={s.num_micro_batches} v={s.virtual_stages}']
    for i in self.instructions:
      what = _Text(i)
      if i.kind in (SEND_ACTIVATION, SEND_GRADIENT):
        what += f'  to device{self.placement[Receiver(i)]}'
      elif i.kind in (schedule_actions.WEIGHT_GRAD, schedule_actions.BACKWARD):
        what += f'  += gradient sum of chunk {i.chunk}'
      lines.append(f'device{self.placement[i.chunk]}: {what}')
    lines.append('reduce: the gradient sums of every replica added; loss and gradients '
                 '/ the losses\' total weight')
    return '\n'.join(lines) + '\n'


def Lower(sched: schedule_lib.Schedule) -> Program:
  """The program of a Schedule: its actions in the order of their clocks, each followed by
  the send of what it made to a chunk on another device."""
  placement, last = sched.placement, sched.num_chunks - 1
  instructions = []
  for step in sched.steps:
    kind, m, c = step.action
    instructions.append(Instruction(kind, m, c))
    if kind == schedule_actions.FORWARD and c < last and placement[c + 1] != placement[c]:
      instructions.append(Instruction(SEND_ACTIVATION, m, c))
    elif (kind in (schedule_actions.INPUT_GRAD, schedule_actions.BACKWARD) and c > 0 and
          placement[c - 1] != placement[c]):
      instructions.append(Instruction(SEND_GRADIENT, m, c))
  return Program(sched, tuple(instructions))

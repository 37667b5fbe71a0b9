"""before.py on hpctrain's parts, 10 lines of code changed (tests/test_tutorial.py counts them):
the test accuracy is the whole test set's, every sample once across the ranks; the run checkpoints
to runs/mnist every 20 steps and on a preemption signal (then exits 3), and the same command
resumes it mid-epoch, bit for bit: ``hpctrain run -n 2 python after.py`` (or torchrun), or
``hpctrain slurm --nodes 2 ... -- after.py`` (requeued when preempted)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

import hpctrain


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout1(x)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, device, train_loader, optimizer, epoch):  # type: ignore[no-untyped-def]
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and dist.get_rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.sampler)}] Loss: {loss.item():.6f}")


def test(model, device, test_loader):  # type: ignore[no-untyped-def]
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data.to(device))
            test_loss += F.nll_loss(output, target.to(device), reduction="sum").item()
            correct += output.argmax(dim=1).eq(target.to(device)).sum().item()
    test_loss, correct, n = hpctrain.sum_over_ranks(test_loss, correct, len(test_loader.sampler))
    if dist.get_rank() == 0:
        print(f"Test set: Average loss: {test_loss / n:.4f}, Accuracy: {correct}/{n} ({100.0 * correct / n:.2f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST, DDP")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--train-samples", type=int, default=None, help="the first N training images (tests)")
    parser.add_argument("--test-samples", type=int, default=None, help="the first N test images (tests)")
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    from data import mnist  # the tutorial's torchvision MNIST (a module beside this script)

    train_set, test_set = mnist(args.train_samples, args.test_samples)
    train_sampler = hpctrain.ResumableSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = hpctrain.EvalSampler(test_set)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)
    model = DDP(Net().to(device))
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    ckpt = hpctrain.LoopCheckpoint("runs/mnist", model, optimizer, scheduler, train_loader, every_steps=20)
    for epoch in range(ckpt.resume(first_epoch=1), args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()
    if args.save_model and rank == 0:
        torch.save(model.module.state_dict(), "mnist_cnn.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

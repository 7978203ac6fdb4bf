# Lightning's DataModule example (the MNISTDataModule of "LightningDataModule"), ported to syncline.
# What differs from Lightning's page: the imports and the name L.LightningDataModule (DataModule). The model and
# the Trainer's limits below are not on that page: they make the program run in seconds. docs/from_lightning.md
# shows this file.
import torch
from torch import nn
from torch.utils.data import DataLoader, random_split

from syncline import DataModule, Task, Trainer  # Lightning: import lightning as L
from syncline.examples.digits import SyntheticMNIST as MNIST  # Lightning: from torchvision.datasets import MNIST
from syncline.examples.digits import transforms  # Lightning: from torchvision import transforms


class MNISTDataModule(DataModule):  # Lightning: L.LightningDataModule
    def __init__(self, data_dir: str = "./"):
        super().__init__()
        self.data_dir = data_dir
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])

    def prepare_data(self):
        # download
        MNIST(self.data_dir, train=True, download=True)
        MNIST(self.data_dir, train=False, download=True)

    def setup(self, stage: str):
        # Assign train/val datasets for use in dataloaders
        if stage == "fit":
            mnist_full = MNIST(self.data_dir, train=True, transform=self.transform)
            self.mnist_train, self.mnist_val = random_split(
                mnist_full, [55000, 5000], generator=torch.Generator().manual_seed(42)
            )

        # Assign test dataset for use in dataloader(s)
        if stage == "test":
            self.mnist_test = MNIST(self.data_dir, train=False, transform=self.transform)

        if stage == "predict":
            self.mnist_predict = MNIST(self.data_dir, train=False, transform=self.transform)

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=32)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=32)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=32)

    def predict_dataloader(self):
        return DataLoader(self.mnist_predict, batch_size=32)


# Not on Lightning's page: a classifier to use the DataModule with.
class LitClassifier(Task):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(dim=1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(dim=1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# Lightning's page: using the DataModule.
dm = MNISTDataModule()
model = LitClassifier()
trainer = Trainer(
    max_epochs=1, limit_train_batches=60, limit_val_batches=4, limit_test_batches=4, limit_predict_batches=4
)
trainer.fit(model, datamodule=dm)
trainer.test(datamodule=dm)
trainer.validate(datamodule=dm)
trainer.predict(datamodule=dm)

"""ClientApp side: masked local training, Fisher estimation and device handling."""

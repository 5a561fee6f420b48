"""Ray worker groups: resource pools over placement groups, one worker class per role, the driver's handle."""

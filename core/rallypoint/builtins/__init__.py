"""The plugins that ship with rallypoint, registered like installed ones."""

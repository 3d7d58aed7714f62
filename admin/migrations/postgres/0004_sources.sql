-- Where a policy came from when it was applied from files (policies as
-- code): the file's name; NULL for a policy made or last edited by hand.
ALTER TABLE policies ADD COLUMN source TEXT;

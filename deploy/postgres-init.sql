-- Run once by the postgres image when its data volume is empty (POSTGRES_DB already created `dagster`): MLflow's
-- tracking store gets its own database, owned by the same role.
CREATE DATABASE mlflow OWNER temper;

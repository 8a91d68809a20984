"""Code the program deploys as AWS Lambda functions (standard library and boto3 only: the Lambda runtime's)."""

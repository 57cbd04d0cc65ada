FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY plugins ./plugins
RUN pip install --no-cache-dir .
EXPOSE 8080
ENTRYPOINT ["warmroute"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
